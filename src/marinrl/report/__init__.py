"""`marinrl report RUN_DIR`: the page and its figures (`page.py`) from what a run wrote (`sources.py`)."""
