"""Where rollout files live under a rollout root: `ROOT/step=00000042/<worker>-<seq>-<uuid>.parquet`, one folder
per weight step (so a listing can skip whole steps without opening a file), and `ROOT/quarantine/` for files a
reader could not decode. The names, their listing, and deleting whole steps (docs/storage.md).
"""

from __future__ import annotations

import re

from marinrl.storage.fs import list_names, open_root, with_retries

QUARANTINE_DIR = "quarantine"
_STEP_DIR = re.compile(r"^step=(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_WORKER_CHARS = 64


def step_dir_name(weight_step: int) -> str:
    return f"step={weight_step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def list_steps(fs, root: str) -> list[int]:
    fs.invalidate_cache(root)
    steps = (parse_step(n) for n in list_names(fs, root))
    return sorted(s for s in steps if s is not None)


def file_name_prefix(worker_id: str) -> str:
    """The worker id as the start of a rollout file's name. Any id is accepted (the file holds the
    exact id; the name only has to be unique and readable), so the prefix keeps [A-Za-z0-9_.-], never
    starts with a dot (readers skip hidden names as writes in progress) and is at most 64 characters
    (file systems cap a name at 255 bytes)."""
    prefix = _UNSAFE.sub("_", worker_id)[:_MAX_WORKER_CHARS]
    return "_" + prefix[1:] if prefix.startswith(".") else prefix


def list_files(fs, root: str, step: int) -> list[str]:
    d = f"{root}/{step_dir_name(step)}"
    fs.invalidate_cache(d)
    return sorted(n for n in list_names(fs, d) if n.endswith(".parquet") and not n.startswith("."))


def delete_steps_before(root: str, step: int, *, storage_options: dict | None = None, fs=None) -> list[int]:
    """Deletes whole weight-step folders below `step` (the quarantine stays); returns the steps deleted."""
    fs, root = open_root(root, storage_options, fs)
    deleted = []
    for s in list_steps(fs, root):
        if s >= step:
            break
        path = f"{root}/{step_dir_name(s)}"
        try:
            with_retries(lambda path=path: fs.rm(path, recursive=True), "deleting", path)
            deleted.append(s)
        except FileNotFoundError:  # another janitor got there first
            pass
    return deleted
