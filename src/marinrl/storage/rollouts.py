"""Durable rollout files over any fsspec filesystem (gs://, file://, memory://, a bare path).

One `RolloutBatch` per Apache Parquet file (`marinrl.storage.format`), one row per rollout, under
`ROOT/step=00000042/<worker>-<seq>-<uuid>.parquet`, so that a listing can skip whole weight steps
without opening a file. A reader never sees a partial file: object stores write a single object
atomically, other filesystems write a hidden temporary name and rename it. No pickle: rollout
buckets are shared and a pickle is code. The format is documented in docs/storage.md.

This module is the writer and the reader; where files live is `layout.py`, the read-only views (`iter_batches`,
`summarize`, re-exported here) `inspection.py`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from marinrl.storage.format import RolloutFormatError, UnsupportedFormatVersion, decode_batch, encode_batch
from marinrl.storage.fs import ATOMIC_PUT_PROTOCOLS, RolloutStorageError, open_root, with_retries
from marinrl.storage.inspection import iter_batches, summarize  # noqa: F401  (re-exported)
from marinrl.storage.layout import (
    QUARANTINE_DIR,
    delete_steps_before,
    file_name_prefix,
    list_files,
    list_steps,
    step_dir_name,
)
from marinrl.types import RolloutBatch

logger = logging.getLogger(__name__)

CURSOR_VERSION = 1
"""The format of `RolloutReader.state_dict()` (its `format_version`); the replay buffer edits cursors of it."""
DEFAULT_CONCURRENT_READS = 16
"""Files a reader fetches at once: storage latency (tens of ms a request on GCS) overlaps across files."""
DEFAULT_RESCAN_EVERY = 100
"""Polls between two listings of a reader's whole root (the rest list only the step folders that can change)."""
PROBE_STEPS = 8
"""Steps below `max_step` a reader lists even before it has seen their folders (a host's late first file)."""
# ----------------------------------------------------------------------------- writer


class RolloutWriter:
    """Writes one file per batch. Many writers (threads, processes, hosts) may share one root.

    `retain_steps`: when set, writing weight step `s` deletes the folders of steps below
    `s - retain_steps` (the retention horizon); the trainer never needs rollouts that stale.
    """

    def __init__(self, root: str, *, retain_steps: int | None = None, storage_options: dict | None = None, fs=None):
        if retain_steps is not None and retain_steps < 0:
            raise ValueError(f"retain_steps must be >= 0 or None, got {retain_steps}")
        self.url = root
        self._fs, self._root = open_root(root, storage_options, fs)
        self._atomic_put = bool(set(np.atleast_1d(self._fs.protocol)) & ATOMIC_PUT_PROTOCOLS)
        self._retain_steps = retain_steps
        self._pruned_below = 0
        self._seq = 0
        self._lock = threading.Lock()
        self.files_written = 0
        self.bytes_written = 0
        self.steps_deleted = 0

    def write(self, batch: RolloutBatch) -> str:
        """Writes `batch` atomically and returns the file's path."""
        data = encode_batch(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
        name = f"{file_name_prefix(batch.metadata.worker_id)}-{seq:06d}-{uuid.uuid4().hex[:12]}.parquet"
        folder = f"{self._root}/{step_dir_name(batch.weight_step)}"
        path = f"{folder}/{name}"
        if self._atomic_put:
            with_retries(lambda: self._fs.pipe_file(path, data), "writing", path)
        else:
            tmp = f"{folder}/.tmp-{name}"
            with_retries(lambda: self._fs.makedirs(folder, exist_ok=True), "creating", folder)
            with_retries(lambda: self._fs.pipe_file(tmp, data), "writing", tmp)
            with_retries(lambda: self._fs.mv(tmp, path), "renaming", tmp)
        with self._lock:
            self.files_written += 1
            self.bytes_written += len(data)
        if self._retain_steps is not None:
            self._apply_retention(batch.weight_step)
        return path

    def _apply_retention(self, step: int) -> None:
        horizon = step - self._retain_steps
        if horizon <= self._pruned_below:
            return
        self._pruned_below = horizon
        try:
            self.steps_deleted += len(delete_steps_before(self._root, horizon, fs=self._fs))
        except RolloutStorageError as e:  # retention is housekeeping: never fatal to a write
            logger.warning("retention below step %d failed: %s", horizon, e)

    @property
    def metrics(self) -> dict[str, int]:
        return {"files_written": self.files_written, "bytes_written": self.bytes_written,
                "steps_deleted": self.steps_deleted}


# ----------------------------------------------------------------------------- reader


class RolloutReader:
    """Reads rollout files incrementally, each exactly once, with a cursor a checkpoint can hold.

    The cursor is `state_dict()`: a floor step (files below it are never returned again) and the
    names consumed in each step at or above it. Restoring it after a restart returns exactly the
    files not returned before the state was saved. A file it cannot read, whatever the reason (not
    Parquet, not ours, a newer format version, not a file at all), is moved to `ROOT/quarantine/` and
    counted, never fatal; transient errors are retried, and a file that still fails stays unconsumed
    for the next call.

    Requests per call follow the files written, not the run's history: given `max_step`, a call lists
    only the step folders that can hold new files (the root on the first call and every
    `rescan_every`-th), and reads a call's files `max_concurrent_reads` at a time (docs/storage.md).
    """

    def __init__(self, root: str, *, storage_options: dict | None = None, fs=None,
                 max_concurrent_reads: int = DEFAULT_CONCURRENT_READS, rescan_every: int = DEFAULT_RESCAN_EVERY):
        if max_concurrent_reads < 1 or rescan_every < 1:
            raise ValueError(f"max_concurrent_reads and rescan_every must be >= 1, got {max_concurrent_reads}, "
                             f"{rescan_every}")
        self.url = root
        self._fs, self._root = open_root(root, storage_options, fs)
        self._floor = 0
        self._consumed: dict[int, set[str]] = defaultdict(set)
        self._known: set[int] = set()
        """Step folders seen at or above the floor: listed every poll, the root only every `rescan_every`."""
        self._polls = 0
        self._rescan_every = rescan_every
        self._max_concurrent_reads = max_concurrent_reads
        self._pool: ThreadPoolExecutor | None = None
        self.files_read = 0
        self.rollouts_read = 0
        self.bytes_read = 0
        self.read_errors = 0
        self.root_listings = 0
        self.quarantined: list[str] = []

    def read_new(self, min_step: int | None = None, max_files: int | None = None,
                 max_step: int | None = None) -> list[RolloutBatch]:
        """Returns the batches of files not returned before, oldest weight step first.

        `min_step`: skip (and forget) files of weight steps below it, for good.
        `max_files`: read at most this many files in this call; the rest wait for the next one.
        `max_step`: the newest weight step that can have new files (the trainer's step), see
        `read_new_with_paths`.
        """
        return [batch for _, batch in self.read_new_with_paths(min_step, max_files, max_step)]

    def _steps_to_list(self, max_step: int | None) -> list[int]:
        """The step folders this poll lists. Without `max_step`, or on the first poll and every
        `rescan_every`-th, the root is listed (one request per 1,000 folders on GCS, so it grows with the
        run's history unless writers set `retain_steps`). Otherwise only the folders that can hold new
        files: those seen at or above the floor, and the `PROBE_STEPS` + 1 steps up to `max_step` (a new
        weight step's folder appears when its first file is written): requests per poll grow with the
        window and the files written, never with the steps the run wrote before."""
        rescan = max_step is None or self._polls % self._rescan_every == 0
        self._polls += 1
        if rescan:
            self.root_listings += 1
            self._known = {s for s in list_steps(self._fs, self._root) if s >= self._floor}
            return sorted(self._known)
        probe = range(max(self._floor, max_step - PROBE_STEPS), max_step + 1)
        return sorted(self._known.union(probe))

    def read_new_with_paths(self, min_step: int | None = None, max_files: int | None = None,
                            max_step: int | None = None):
        if min_step is not None and min_step > self._floor:
            self._floor = min_step
            for s in [s for s in self._consumed if s < min_step]:
                del self._consumed[s]
            self._known = {s for s in self._known if s >= min_step}
        todo: list[tuple[int, str, str]] = []  # (step, name, path) of the files to read, in order
        for step in self._steps_to_list(max_step):
            if step < self._floor:
                continue
            names = list_files(self._fs, self._root, step)
            if names:
                self._known.add(step)
            else:  # deleted by retention, or not written yet (the probe lists it again while it is recent)
                self._known.discard(step)
            consumed = self._consumed[step] if names else self._consumed.get(step, ())
            for name in names:
                if name in consumed:
                    continue
                if max_files is not None and len(todo) >= max_files:
                    break
                todo.append((step, name, f"{self._root}/{step_dir_name(step)}/{name}"))
            if max_files is not None and len(todo) >= max_files:
                break
        out: list[tuple[str, RolloutBatch]] = []
        for (step, name, path), (data, error) in zip(todo, self._fetch_all([p for _, _, p in todo])):
            consumed = self._consumed[step]
            if isinstance(error, FileNotFoundError):  # deleted by retention between listing and reading
                consumed.add(name)
                continue
            if isinstance(error, RolloutStorageError):
                self.read_errors += 1
                if out:  # hand back what was read; this file and those after it are retried next call
                    return out
                raise error
            if error is not None:  # not transient (a folder, no permission): retrying cannot help
                self._quarantine(step, name, path, f"{self._display(path)}: cannot be read ({error!r})")
                consumed.add(name)
                continue
            try:
                batch = decode_batch(data, self._display(path))
            except UnsupportedFormatVersion as e:
                self._quarantine(step, name, path, f"{e} to train on it")
                consumed.add(name)
                continue
            except RolloutFormatError as e:
                self._quarantine(step, name, path, str(e))
                consumed.add(name)
                continue
            consumed.add(name)
            self.files_read += 1
            self.rollouts_read += len(batch)
            self.bytes_read += len(data)
            out.append((self._display(path), batch))
        return out

    def _fetch_all(self, paths: list[str]) -> list[tuple[bytes | None, BaseException | None]]:
        """Each path's bytes or the error reading it, in order, at most `max_concurrent_reads` at a time."""

        def fetch(path):
            try:
                return with_retries(lambda: self._fs.cat_file(path), "reading", path), None
            except OSError as e:  # FileNotFoundError, RolloutStorageError and other OSErrors: the caller sorts
                return None, e

        if len(paths) <= 1 or self._max_concurrent_reads == 1:
            return [fetch(p) for p in paths]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_concurrent_reads, thread_name_prefix="rollout-read")
        return list(self._pool.map(fetch, paths))

    def close(self) -> None:
        """Stops the read threads (a later read starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _display(self, path: str) -> str:
        return self._fs.unstrip_protocol(path)

    def _quarantine(self, step: int, name: str, path: str, reason: str) -> None:
        """Moves an unreadable file aside (or, if that fails too, skips it in place) and counts it."""
        logger.error("quarantining unreadable rollout file: %s", reason)
        dest = f"{self._root}/{QUARANTINE_DIR}/{step_dir_name(step)}/{name}"
        try:
            self._fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            with_retries(lambda: self._fs.mv(path, dest), "quarantining", path)
        except (OSError, RolloutStorageError) as e:
            logger.error("could not move %s to the quarantine (%r); skipping it in place", path, e)
        self.quarantined.append(self._display(dest))

    def state_dict(self) -> dict:
        """The cursor as plain JSON-able data."""
        return {
            "format_version": CURSOR_VERSION,
            "floor": self._floor,
            "consumed": {str(s): sorted(names) for s, names in sorted(self._consumed.items()) if names},
        }

    def load_state_dict(self, state: dict) -> None:
        try:
            floor = int(state["floor"])
            consumed = {int(s): set(map(str, names)) for s, names in state["consumed"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"RolloutReader state is malformed ({e!r}): {state!r:.200}") from e
        self._floor = floor
        self._consumed = defaultdict(set, consumed)

    @property
    def metrics(self) -> dict[str, int]:
        return {"files_read": self.files_read, "rollouts_read": self.rollouts_read, "bytes_read": self.bytes_read,
                "read_errors": self.read_errors, "quarantined_files": len(self.quarantined),
                "root_listings": self.root_listings}


