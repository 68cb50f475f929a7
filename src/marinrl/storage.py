"""Durable rollout files over any fsspec filesystem (gs://, file://, memory://, a bare path).

One `RolloutBatch` per Apache Parquet file, one row per rollout, under
`ROOT/step=00000042/<worker>-<seq>-<uuid>.parquet`, so that a listing can skip whole weight steps
without opening a file. A reader never sees a partial file: object stores write a single object
atomically, other filesystems write a hidden temporary name and rename it. No pickle: rollout
buckets are shared and a pickle is code. The format is documented in docs/storage.md.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
import threading
import time
import uuid
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable, TypeVar

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marinrl.types import FINISH_REASONS, Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
VERSION_KEY = b"marinrl.format_version"
BATCH_KEY = b"marinrl.batch"
QUARANTINE_DIR = "quarantine"
_STEP_DIR = re.compile(r"^step=(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_WORKER_CHARS = 64
ATOMIC_PUT_PROTOCOLS = {"gs", "gcs", "s3", "s3a", "memory", "az", "abfs", "abfss"}
"""Object stores whose single-object writes are atomic; everything else writes a temp name and renames
(weight transfer follows the same rule)."""



def _list(value_type: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("item", value_type, nullable=False))


# Every field is non-nullable: Parquet then stores no definition levels, which makes reads ~1.5× faster.
SCHEMA = pa.schema(
    [
        pa.field(name, type_, nullable=False)
        for name, type_ in [
            ("group_id", pa.string()),
            ("prompt_tokens", _list(pa.int32())),
            ("response_tokens", _list(pa.int32())),
            ("response_logprobs", _list(pa.float32())),
            ("loss_mask", _list(pa.bool_())),
            ("token_rewards", _list(pa.float32())),
            ("temperature", pa.float64()),
            ("episode_reward", pa.float64()),
            ("finish_reason", pa.string()),
            ("env_name", pa.string()),
            ("lesson_id", pa.string()),
            ("agent_name", pa.string()),
            ("policy_name", pa.string()),
            ("worker_id", pa.string()),
            ("weight_step", pa.int64()),
            ("created_at", pa.float64()),
        ]
    ]
)
_LIST_COLUMNS = {
    "prompt_tokens": np.int32,
    "response_tokens": np.int32,
    "response_logprobs": np.float32,
    "loss_mask": np.bool_,
    "token_rewards": np.float32,
}
_STRING_COLUMNS = ("group_id", "finish_reason", "env_name", "lesson_id", "agent_name", "policy_name", "worker_id")


class RolloutStorageError(OSError):
    """A filesystem operation that kept failing after retries; the message names the path."""


class RolloutFormatError(ValueError):
    """A file that is not a valid rollout file of a format version this reader knows."""


class UnsupportedFormatVersion(RolloutFormatError):
    """A file written by a newer marinrl: not corrupt, but this reader cannot decode it (a reader
    quarantines it like any unreadable file, with a log line that says to upgrade marinrl)."""


# ----------------------------------------------------------------------------- encoding


def _list_array(arrays: list[np.ndarray], dtype, pa_type: pa.DataType) -> pa.Array:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa_type.value_type))


def encode_batch(batch: RolloutBatch) -> bytes:
    """Serializes one batch to the bytes of one Parquet file."""
    rollouts = batch.rollouts
    cols: dict[str, Any] = {}
    for name, dtype in _LIST_COLUMNS.items():
        cols[name] = _list_array([getattr(r, name) for r in rollouts], dtype, SCHEMA.field(name).type)
    for name in _STRING_COLUMNS:
        src = (lambda r: r.metadata.worker_id) if name == "worker_id" else (lambda r, n=name: getattr(r, n))
        cols[name] = pa.array([src(r) for r in rollouts], type=pa.string())
    cols["temperature"] = pa.array([r.temperature for r in rollouts], type=pa.float64())
    cols["episode_reward"] = pa.array([r.episode_reward for r in rollouts], type=pa.float64())
    cols["weight_step"] = pa.array([r.metadata.weight_step for r in rollouts], type=pa.int64())
    cols["created_at"] = pa.array([r.metadata.created_at for r in rollouts], type=pa.float64())
    meta = batch.metadata
    file_meta = {
        VERSION_KEY: str(FORMAT_VERSION).encode(),
        BATCH_KEY: json.dumps(
            {"worker_id": meta.worker_id, "weight_step": meta.weight_step, "created_at": meta.created_at,
             "group_order": [g.group_id for g in batch.groups]}
        ).encode(),
    }
    table = pa.table([cols[f.name] for f in SCHEMA], schema=SCHEMA.with_metadata(file_meta))
    sink = io.BytesIO()
    # Dictionary-encode only the repetitive string columns: on token ids it makes files larger and
    # slower to read. lz4 read fastest of zstd/lz4/snappy/none at ~0.55× pickle's size (bench/storage.py).
    pq.write_table(table, sink, compression="lz4", use_dictionary=list(_STRING_COLUMNS), write_statistics=False)
    return sink.getvalue()


def _fail(path: str, problem: str) -> None:
    raise RolloutFormatError(f"{path}: {problem}")


def decode_batch(data: bytes, path: str = "<bytes>") -> RolloutBatch:
    """Parses the bytes of one rollout file; raises RolloutFormatError naming `path` and the field.

    Validation is done once per column over the whole file rather than rollout by rollout; it
    checks what `Rollout.__post_init__` checks, so a decoded batch is as trustworthy as a built one.
    The bytes are untrusted: whatever pyarrow or our checks raise becomes a RolloutFormatError.
    """
    try:
        return _decode(data, path)
    except RolloutFormatError:
        raise
    except Exception as e:
        raise RolloutFormatError(f"{path}: not a valid rollout file ({type(e).__name__}: {e})") from e


def _decode(data: bytes, path: str) -> RolloutBatch:
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
        file_meta = pf.schema_arrow.metadata or {}
    except Exception as e:
        _fail(path, f"not a readable Parquet file ({e})")
    version = file_meta.get(VERSION_KEY)
    if version is None:
        _fail(path, f"missing {VERSION_KEY.decode()} in the file metadata: not a marinrl rollout file")
    try:
        version_int = int(version)
    except ValueError:
        _fail(path, f"format version {version!r} is not an integer")
    if version_int > FORMAT_VERSION:
        raise UnsupportedFormatVersion(
            f"{path}: format version {version_int} is newer than this reader's {FORMAT_VERSION}; upgrade marinrl"
        )
    if version_int < 1:
        _fail(path, f"unknown format version {version_int}")
    try:
        table = pf.read(use_threads=False)  # small files: a thread pool costs more than it saves
    except Exception as e:
        _fail(path, f"cannot read the Parquet data ({e})")
    present = set(table.column_names)
    missing = [name for name in SCHEMA.names if name not in present]
    if missing:
        _fail(path, f"missing columns {missing}")
    table = table.select(SCHEMA.names)
    if not table.schema.equals(SCHEMA, check_metadata=False):
        try:
            table = table.cast(SCHEMA.with_metadata(None))
        except Exception as e:
            _fail(path, f"columns of the wrong type ({e})")
    try:
        batch_meta = json.loads(file_meta[BATCH_KEY])
        metadata = RolloutMetadata(batch_meta["worker_id"], batch_meta["weight_step"], batch_meta["created_at"])
        group_order = list(batch_meta["group_order"])
    except (KeyError, TypeError, ValueError) as e:
        _fail(path, f"bad batch metadata {BATCH_KEY.decode()} ({e!r})")
    n = table.num_rows
    if n == 0:
        _fail(path, "holds no rollouts")

    # Columnar views: one flat array plus offsets per list column.
    flat: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, dtype in _LIST_COLUMNS.items():
        col = table.column(name)
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        if arr.null_count:
            _fail(path, f"column {name} has null rows")
        offsets = arr.offsets.to_numpy().astype(np.int64)
        values = arr.flatten().to_numpy(zero_copy_only=False)
        if values.dtype != dtype:
            values = values.astype(dtype)
        flat[name] = (values, offsets - offsets[0])
    lengths = np.diff(flat["response_tokens"][1])
    if np.any(lengths == 0):
        _fail(path, f"row {int(np.flatnonzero(lengths == 0)[0])}: response_tokens is empty")
    for name in ("response_logprobs", "loss_mask", "token_rewards"):
        other = np.diff(flat[name][1])
        if not np.array_equal(other, lengths):
            row = int(np.flatnonzero(other != lengths)[0])
            _fail(path, f"row {row}: {name} has length {other[row]} but response_tokens has length {lengths[row]}")
    for name in ("prompt_tokens", "response_tokens"):
        if flat[name][0].size and flat[name][0].min() < 0:
            _fail(path, f"{name} holds a negative token id")
    for name in ("response_logprobs", "token_rewards"):
        if not np.all(np.isfinite(flat[name][0])):
            _fail(path, f"{name} holds a non-finite value")
    if np.any(flat["response_logprobs"][0] > 1e-4):
        _fail(path, "response_logprobs holds a positive log-probability")

    scalars = {name: table.column(name).to_numpy(zero_copy_only=False) for name in
               ("temperature", "episode_reward", "weight_step", "created_at")}
    for name in ("temperature", "episode_reward", "created_at"):
        if not np.all(np.isfinite(scalars[name])):
            _fail(path, f"{name} holds a non-finite value")
    if np.any(scalars["temperature"] < 0):
        _fail(path, "temperature holds a negative value")
    if np.any(scalars["weight_step"] != metadata.weight_step):
        _fail(path, f"weight_step of a row differs from the batch's {metadata.weight_step}")
    strings = {name: table.column(name).to_pylist() for name in _STRING_COLUMNS}
    for name, values in strings.items():
        if "" in values or None in values:
            _fail(path, f"{name} holds an empty or null string")
    bad_reasons = set(strings["finish_reason"]) - set(FINISH_REASONS)
    if bad_reasons:
        _fail(path, f"finish_reason holds unknown values {sorted(bad_reasons)}")

    split = {}
    for name, (values, offsets) in flat.items():
        bounds = offsets.tolist()
        split[name] = [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    temperature, episode_reward = scalars["temperature"].tolist(), scalars["episode_reward"].tolist()
    created_at = scalars["created_at"].tolist()
    metas: dict[tuple[str, float], RolloutMetadata] = {}
    by_group: dict[str, list[Rollout]] = defaultdict(list)
    for i in range(n):
        key = (strings["worker_id"][i], created_at[i])
        meta = metas.get(key)
        if meta is None:
            meta = metas[key] = RolloutMetadata(key[0], metadata.weight_step, key[1])
        rollout = object.__new__(Rollout)  # columns were validated in bulk above
        rollout.__dict__.update(
            prompt_tokens=split["prompt_tokens"][i],
            response_tokens=split["response_tokens"][i],
            response_logprobs=split["response_logprobs"][i],
            temperature=temperature[i],
            loss_mask=split["loss_mask"][i],
            token_rewards=split["token_rewards"][i],
            episode_reward=episode_reward[i],
            finish_reason=strings["finish_reason"][i],
            env_name=strings["env_name"][i],
            lesson_id=strings["lesson_id"][i],
            group_id=strings["group_id"][i],
            metadata=meta,
            agent_name=strings["agent_name"][i],
            policy_name=strings["policy_name"][i],
        )
        by_group[rollout.group_id].append(rollout)
    if len(group_order) != len(by_group) or set(group_order) != by_group.keys():
        _fail(path, "group_order in the batch metadata does not match the group_id column")
    groups = []
    for g in group_order:  # consistent by construction: one group_id each, one weight_step per file
        group = object.__new__(RolloutGroup)
        group.__dict__["rollouts"] = tuple(by_group[g])
        groups.append(group)
    batch = object.__new__(RolloutBatch)
    batch.__dict__.update(groups=tuple(groups), metadata=metadata)
    return batch


# ----------------------------------------------------------------------------- filesystem helpers

T = TypeVar("T")


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    try:
        from gcsfs.retry import HttpError
    except ImportError:  # pragma: no cover - gcsfs is a dependency
        return False
    return isinstance(e, HttpError) and (getattr(e, "code", None) in (None, 408, 429) or e.code >= 500)


def with_retries(fn: Callable[[], T], what: str, path: str, attempts: int = 4, backoff_s: float = 0.05) -> T:
    """Runs `fn`, retrying transient filesystem errors with exponential backoff and jitter."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if not _is_transient(e):
                raise
            if attempt == attempts - 1:
                raise RolloutStorageError(f"{what} {path} failed after {attempts} attempts: {e!r}") from e
            delay = backoff_s * (2**attempt) * (0.5 + random.random())
            logger.warning("%s %s failed (%r); retrying in %.2fs", what, path, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def open_root(root: str, storage_options: dict | None, fs: fsspec.AbstractFileSystem | None):
    """(filesystem, path without a trailing slash) of an fsspec URL, or of `root` on a given `fs`."""
    if fs is not None:
        return fs, fs._strip_protocol(root).rstrip("/")
    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    return fs, path.rstrip("/")


def step_dir_name(weight_step: int) -> str:
    return f"step={weight_step:08d}"


def _parse_step(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def list_names(fs, path: str) -> list[str]:
    """Base names under `path` (none if it does not exist), the listing retried on transient errors."""
    try:
        return [_basename(p) for p in with_retries(lambda: fs.ls(path, detail=False), "listing", path)]
    except FileNotFoundError:
        return []


def _list_steps(fs, root: str) -> list[int]:
    fs.invalidate_cache(root)
    steps = (_parse_step(n) for n in list_names(fs, root))
    return sorted(s for s in steps if s is not None)


def file_name_prefix(worker_id: str) -> str:
    """The worker id as the start of a rollout file's name. Any id is accepted (the file holds the
    exact id; the name only has to be unique and readable), so the prefix keeps [A-Za-z0-9_.-], never
    starts with a dot (readers skip hidden names as writes in progress) and is at most 64 characters
    (file systems cap a name at 255 bytes)."""
    prefix = _UNSAFE.sub("_", worker_id)[:_MAX_WORKER_CHARS]
    return "_" + prefix[1:] if prefix.startswith(".") else prefix


def _list_files(fs, root: str, step: int) -> list[str]:
    d = f"{root}/{step_dir_name(step)}"
    fs.invalidate_cache(d)
    return sorted(n for n in list_names(fs, d) if n.endswith(".parquet") and not n.startswith("."))


def delete_steps_before(root: str, step: int, *, storage_options: dict | None = None, fs=None) -> list[int]:
    """Deletes whole weight-step folders below `step` (the quarantine stays); returns the steps deleted."""
    fs, root = open_root(root, storage_options, fs)
    deleted = []
    for s in _list_steps(fs, root):
        if s >= step:
            break
        path = f"{root}/{step_dir_name(s)}"
        try:
            with_retries(lambda: fs.rm(path, recursive=True), "deleting", path)
            deleted.append(s)
        except FileNotFoundError:  # another janitor got there first
            pass
    return deleted


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
    """

    def __init__(self, root: str, *, storage_options: dict | None = None, fs=None):
        self.url = root
        self._fs, self._root = open_root(root, storage_options, fs)
        self._floor = 0
        self._consumed: dict[int, set[str]] = defaultdict(set)
        self.files_read = 0
        self.rollouts_read = 0
        self.bytes_read = 0
        self.read_errors = 0
        self.quarantined: list[str] = []

    def read_new(self, min_step: int | None = None, max_files: int | None = None) -> list[RolloutBatch]:
        """Returns the batches of files not returned before, oldest weight step first.

        `min_step`: skip (and forget) files of weight steps below it, for good.
        `max_files`: read at most this many files in this call; the rest wait for the next one.
        """
        return [batch for _, batch in self.read_new_with_paths(min_step, max_files)]

    def read_new_with_paths(self, min_step: int | None = None, max_files: int | None = None):
        if min_step is not None and min_step > self._floor:
            self._floor = min_step
            for s in [s for s in self._consumed if s < min_step]:
                del self._consumed[s]
        out: list[tuple[str, RolloutBatch]] = []
        for step in _list_steps(self._fs, self._root):
            if step < self._floor:
                continue
            consumed = self._consumed[step]
            for name in _list_files(self._fs, self._root, step):
                if name in consumed:
                    continue
                if max_files is not None and len(out) >= max_files:
                    return out
                path = f"{self._root}/{step_dir_name(step)}/{name}"
                try:
                    data = with_retries(lambda: self._fs.cat_file(path), "reading", path)
                except FileNotFoundError:  # deleted by retention between listing and reading
                    consumed.add(name)
                    continue
                except RolloutStorageError:
                    self.read_errors += 1
                    if out:  # hand back what was read; this file is retried next call
                        return out
                    raise
                except OSError as e:  # not transient (a folder, no permission): retrying cannot help
                    self._quarantine(step, name, path, f"{self._display(path)}: cannot be read ({e!r})")
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
            "format_version": FORMAT_VERSION,
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
                "read_errors": self.read_errors, "quarantined_files": len(self.quarantined)}


# ----------------------------------------------------------------------------- inspection


def iter_files(root: str, *, storage_options: dict | None = None, fs=None) -> Iterable[tuple[int, str, bytes]]:
    """Yields (weight_step, path, bytes) for every rollout file under `root`; changes nothing."""
    fs, root_path = open_root(root, storage_options, fs)
    for step in _list_steps(fs, root_path):
        for name in _list_files(fs, root_path, step):
            path = f"{root_path}/{step_dir_name(step)}/{name}"
            try:
                yield step, fs.unstrip_protocol(path), with_retries(lambda: fs.cat_file(path), "reading", path)
            except FileNotFoundError:
                continue


def summarize(root: str, *, storage_options: dict | None = None, fs=None) -> dict:
    """What `marinrl inspect` prints: per weight step and per environment, plus unreadable files."""
    fs, root_path = open_root(root, storage_options, fs)
    per_step: dict[int, dict] = {}
    per_env: dict[str, dict] = defaultdict(lambda: {"rollouts": 0, "rewards": [], "lengths": [], "finish": Counter()})
    unreadable = []
    for step, path, data in iter_files(root_path, fs=fs):
        s = per_step.setdefault(step, {"files": 0, "rollouts": 0, "groups": 0, "rewards": []})
        try:
            batch = decode_batch(data, path)
        except RolloutFormatError as e:
            unreadable.append(str(e))
            continue
        s["files"] += 1
        s["groups"] += len(batch.groups)
        for r in batch.rollouts:
            s["rollouts"] += 1
            s["rewards"].append(r.episode_reward)
            e = per_env[r.env_name]
            e["rollouts"] += 1
            e["rewards"].append(r.episode_reward)
            e["lengths"].append(r.response_tokens.size)
            e["finish"][r.finish_reason] += 1
    quarantined = sum(1 for _ in _walk_files(fs, f"{root_path}/{QUARANTINE_DIR}"))

    def stats(values):
        return {"mean": float(np.mean(values)), "std": float(np.std(values))} if values else None

    return {
        "root": root,
        "steps": {
            str(step): {"files": v["files"], "rollouts": v["rollouts"], "groups": v["groups"],
                        "reward": stats(v["rewards"])}
            for step, v in sorted(per_step.items())
        },
        "envs": {
            env: {"rollouts": v["rollouts"], "reward": stats(v["rewards"]), "response_length": stats(v["lengths"]),
                  "finish_reasons": dict(v["finish"])}
            for env, v in sorted(per_env.items())
        },
        "totals": {
            "files": sum(v["files"] for v in per_step.values()),
            "rollouts": sum(v["rollouts"] for v in per_step.values()),
            "groups": sum(v["groups"] for v in per_step.values()),
            "unreadable": len(unreadable),
            "quarantined": quarantined,
        },
        "unreadable": unreadable,
    }


def _walk_files(fs, path: str) -> Iterable[str]:
    fs.invalidate_cache(path)
    try:
        for _, _, files in fs.walk(path):
            yield from files
    except FileNotFoundError:
        return
