"""The curriculum: lessons, their unlocking and graduation and sampling weights, clocked by trainer steps
(`lessons.py`), and the Ray actor that holds it for a job, its saved state and its client (`actor.py`)
(docs/curriculum.md)."""
