"""The rollout file format: one `RolloutBatch` per Apache Parquet file, one row per rollout.

Encoding and validated decoding (docs/storage.md). No pickle: rollout buckets are shared and a
pickle is code. Where the files live, and who reads them when, is `marinrl.storage.rollouts`.
"""

from __future__ import annotations

import io
import json
import zlib
from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marinrl.types import FINISH_REASONS, Rollout, RolloutBatch, RolloutGroup, RolloutMetadata

FORMAT_VERSION = 2
"""2 added `weight_steps` (the weight step of each response token); files of version 1 still read, with
every token at the rollout's weight step."""
VERSION_KEY = b"marinrl.format_version"
BATCH_KEY = b"marinrl.batch"
CRC_KEY = b"marinrl.crc32"
"""CRC-32 of the file's bytes before the Parquet footer (every column's pages) and of the version and
batch metadata: a file damaged after writing is refused, never read as other values (lz4 pages carry
no checksum of their own). Files written without it read unchecked."""


def _content_crc(data_region: bytes, version: bytes, batch: bytes) -> int:
    return zlib.crc32(batch, zlib.crc32(version, zlib.crc32(data_region)))


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
            ("weight_steps", _list(pa.int64())),
        ]
    ]
)
SCHEMA_V1 = pa.schema([f for f in SCHEMA if f.name != "weight_steps"])
"""Version 1: no `weight_steps` column."""
_LIST_COLUMNS = {
    "prompt_tokens": np.int32,
    "response_tokens": np.int32,
    "response_logprobs": np.float32,
    "loss_mask": np.bool_,
    "token_rewards": np.float32,
    "weight_steps": np.int64,
}
_STRING_COLUMNS = ("group_id", "finish_reason", "env_name", "lesson_id", "agent_name", "policy_name", "worker_id")


class RolloutFormatError(ValueError):
    """A file that is not a valid rollout file of a format version this reader knows."""


class UnsupportedFormatVersion(RolloutFormatError):
    """A file written by a newer marinrl: not corrupt, but this reader cannot decode it (a reader
    quarantines it like any unreadable file, with a log line that says to upgrade marinrl)."""


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
        attr = "token_weight_steps" if name == "weight_steps" else name
        cols[name] = _list_array([getattr(r, attr) for r in rollouts], dtype, SCHEMA.field(name).type)
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
    with pq.ParquetWriter(sink, table.schema, compression="lz4", use_dictionary=list(_STRING_COLUMNS),
                          write_statistics=False) as writer:
        writer.write_table(table)
        crc = _content_crc(sink.getvalue(), file_meta[VERSION_KEY], file_meta[BATCH_KEY])  # the pages, written
        writer.add_key_value_metadata({CRC_KEY: str(crc).encode()})
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
    crc = (pf.metadata.metadata or {}).get(CRC_KEY)
    if crc is not None:
        footer = 8 + int.from_bytes(data[-8:-4], "little")
        if _content_crc(data[:len(data) - footer], version or b"", file_meta.get(BATCH_KEY, b"")) != int(crc):
            _fail(path, "CRC-32 mismatch: the file was damaged after it was written")
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
    schema = SCHEMA if version_int >= 2 else SCHEMA_V1
    present = set(table.column_names)
    missing = [name for name in schema.names if name not in present]
    if missing:
        _fail(path, f"missing columns {missing}")
    table = table.select(schema.names)
    if not table.schema.equals(schema, check_metadata=False):
        try:
            table = table.cast(schema.with_metadata(None))
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
        if name not in schema.names:
            continue
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
    for name in ("response_logprobs", "loss_mask", "token_rewards", "weight_steps"):
        if name not in flat:
            continue
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
    uniform_steps = None  # per row: every token at the batch's weight step (stored as None, as built)
    if "weight_steps" in flat:
        steps, offsets = flat["weight_steps"]
        if steps.size and steps.min() < metadata.weight_step:
            _fail(path, f"weight_steps holds step {int(steps.min())}, below the batch's weight_step "
                        f"{metadata.weight_step}")
        falls = np.flatnonzero(np.diff(steps) < 0) + 1  # a decrease inside a row (row starts excluded)
        starts = set(offsets[1:-1].tolist())
        if any(int(i) not in starts for i in falls):
            _fail(path, "weight_steps decreases inside a row: weights only move forward within a rollout")
        newer = np.add.reduceat(steps > metadata.weight_step, offsets[:-1]) if steps.size else np.zeros(n)
        uniform_steps = newer == 0
    strings = {name: table.column(name).to_pylist() for name in _STRING_COLUMNS}
    for name, values in strings.items():
        if "" in values or None in values:
            _fail(path, f"{name} holds an empty or null string")
    bad_reasons = set(strings["finish_reason"]) - set(FINISH_REASONS)
    if bad_reasons:
        _fail(path, f"finish_reason holds unknown values {sorted(bad_reasons)}")

    split: dict[str, list] = {"weight_steps": [None] * n}
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
            weight_steps=None if uniform_steps is None or uniform_steps[i] else split["weight_steps"][i],
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
