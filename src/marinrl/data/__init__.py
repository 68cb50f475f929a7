"""Small data shipped with marinrl for tests and the CPU demo; written for this project, nothing downloaded.

- `gsm8k_mini_train.jsonl` (25 rows) and `gsm8k_mini_eval.jsonl` (8 rows): grade-school word problems in
  the GSM8K layout, `{"question": ..., "answer": "<reasoning>\\n#### <final answer>"}`.
"""

from __future__ import annotations

import importlib.resources
import os


def data_path(name: str) -> str:
    """Filesystem path of a shipped data file; FileNotFoundError names it if it does not exist."""
    path = os.fspath(importlib.resources.files(__name__) / name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no shipped data file {name!r} in {os.path.dirname(path)}")
    return path
