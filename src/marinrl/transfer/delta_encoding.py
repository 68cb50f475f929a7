"""The per-array encodings of a delta (transfer/delta.py): how one array's change since the previous version is
written as a few data leaves, and written back into the previous array. The cheapest of:

- `same`: no bytes;
- `elements`: the positions, as uint16 offsets in 65,536-element chunks plus a count per chunk, and the new
  values of the changed elements;
- `ulps`: the positions as 1-byte gaps and each change as a 1-byte count of units in the last place
  (`ulp_steps`);
- `blocks`: the indices and contents of the changed fixed-size blocks;
- `dense`: the whole array.

Comparisons and writes work on the bits (unsigned views), so NaNs, -0.0 and bf16 round-trip exactly.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from marinrl.transfer.base import WeightFormatError

ENCODINGS = ("same", "elements", "ulps", "blocks", "dense")
BLOCK_ELEMENTS = 64
"""Elements per block of the `blocks` encoding (128 bytes of bf16, 256 of fp32)."""
INDEX_DTYPE = np.dtype("<u4")
CHUNK_BITS = 16
"""`elements` stores each changed element's offset inside its 65,536-element chunk (uint16) and a
count per chunk (uint32): 2 bytes per index instead of 4."""
LOCAL_DTYPE = np.dtype("<u2")
GAP_DTYPE, ULP_DTYPE = np.dtype("u1"), np.dtype("i1")
GAP_MAX = 255
"""`ulps` gap 0 is a filler: the position advances by GAP_MAX and no element is changed there."""
ESCAPE = 0
"""`ulps` step 0 (never a change): the element's new bits are the next of the `val` leaf instead."""
DATA_LEAVES = {"elements": ("cnt", "idx", "val"), "ulps": ("gap", "ulp", "val"), "blocks": ("idx", "val"),
               "dense": ("val",), "same": ()}
"""The data leaves of each encoding, named `<leaf>#<part>`, in this order."""
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as flat unsigned integers of the same width (a view where possible)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.dtype.itemsize not in _UINT:
        raise WeightFormatError(f"cannot encode a delta of dtype {flat.dtype.name}")
    return flat.view(_UINT[flat.dtype.itemsize])


def array_crc(a: np.ndarray) -> int:
    """CRC-32 of the array's bytes in C order: the per-array checksum both sides compute."""
    return zlib.crc32(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


def encode_array(name: str, old: np.ndarray, new: np.ndarray, encodings: Sequence[str],
                 block: int = BLOCK_ELEMENTS) -> tuple[str, list[str], list[np.ndarray]]:
    """(encoding, data leaf names, data leaves) for `new` given `old`: the smallest of `encodings`."""
    if old.shape != new.shape or old.dtype != new.dtype:
        return "dense", [f"{name}#val"], [new]
    old_bits, new_bits = _bits(old), _bits(new)
    changed = old_bits != new_bits
    idx = np.flatnonzero(changed)
    n_changed = idx.size
    if n_changed == 0:
        return "same", [], []
    size, itemsize = new_bits.size, new.dtype.itemsize
    options = {"dense": size * itemsize}
    n_chunks = -(-size // (1 << CHUNK_BITS))
    if "elements" in encodings:
        options["elements"] = n_changed * (LOCAL_DTYPE.itemsize + itemsize) + n_chunks * INDEX_DTYPE.itemsize
    if "ulps" in encodings:
        steps = ulp_steps(old_bits[idx], new_bits[idx])
        cost = 2 * n_changed + int(np.count_nonzero(steps == ESCAPE)) * itemsize
        if cost < min(options.values()):  # else its fillers cannot make it the cheapest
            gaps = ulp_gaps(idx)
            options["ulps"] = cost - n_changed + gaps.size
    if "blocks" in encodings and size < 2**32 * block:
        padded = np.zeros(-(-size // block) * block, bool)
        padded[:size] = changed
        changed_blocks = np.flatnonzero(padded.reshape(-1, block).any(axis=1))
        options["blocks"] = changed_blocks.size * (INDEX_DTYPE.itemsize + block * itemsize)
    encoding = min(options, key=lambda k: (options[k], k != "dense"))
    if encoding == "elements":
        counts = np.bincount(idx >> CHUNK_BITS, minlength=n_chunks).astype(INDEX_DTYPE)
        local = (idx & ((1 << CHUNK_BITS) - 1)).astype(LOCAL_DTYPE)
        return encoding, data_leaf_names(name, encoding), [counts, local, new_bits[idx]]
    if encoding == "ulps":
        return encoding, data_leaf_names(name, encoding), [gaps, steps, new_bits[idx[steps == ESCAPE]]]
    if encoding == "blocks":
        values = np.zeros((changed_blocks.size, block), new_bits.dtype)
        full = new_bits[: size // block * block].reshape(-1, block)
        inner = changed_blocks[changed_blocks < full.shape[0]]
        values[: inner.size] = full[inner]
        if inner.size < changed_blocks.size:  # the last, partial block
            tail = new_bits[full.shape[0] * block:]
            values[-1, : tail.size] = tail
        return encoding, data_leaf_names(name, encoding), [changed_blocks.astype(INDEX_DTYPE), values]
    return "dense", [f"{name}#val"], [new]


def ulp_steps(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The `ulps` steps of changed elements whose bits (unsigned) go from `old` to `new`. A small step
    moves most bf16 elements by a few units in the last place, i.e. their bits by a small integer:
    new - old (wrapping) as int8, or ESCAPE where it does not fit (sign flips, NaNs, large moves: the
    new bits then go whole in `val`)."""
    diff = (new - old).view(_INT[new.dtype.itemsize])
    return np.where((diff >= -128) & (diff <= 127), diff, ESCAPE).astype(ULP_DTYPE)


def ulp_gaps(idx: np.ndarray) -> np.ndarray:
    """The `ulps` gaps of the sorted positions `idx`: each one's distance from the previous (the first's
    from -1) in a uint8, preceded by a filler (0) for each GAP_MAX it exceeds."""
    dist = np.diff(idx, prepend=-1)
    far = np.flatnonzero(dist > GAP_MAX)
    fillers = (dist[far] - 1) // GAP_MAX
    dist[far] -= fillers * GAP_MAX
    return np.insert(dist.astype(GAP_DTYPE), np.repeat(far, fillers), 0)


def data_leaf_names(name: str, encoding: str) -> list[str]:
    """The names of `name`'s data leaves under `encoding` (`DATA_LEAVES`), in the order they are written."""
    return [f"{name}#{part}" for part in DATA_LEAVES[encoding]]


def apply_array(name: str, encoding: str, old: np.ndarray, data: Sequence[np.ndarray],
                block: int, where: str) -> np.ndarray:
    """A new array: `old` with the encoded changes written in. Never modifies `old`."""
    if encoding == "dense":
        (val,) = data
        if val.shape != old.shape or val.dtype != old.dtype:
            raise WeightFormatError(f"{where}: dense {name} is {val.dtype.name}{list(val.shape)}")
        return val
    new = np.array(old, copy=True, order="C")
    bits = _bits(new)  # a view of `new`
    if encoding == "elements":
        counts, local, val = data
        n_chunks = -(-bits.size // (1 << CHUNK_BITS))
        if (counts.dtype != INDEX_DTYPE or local.dtype != LOCAL_DTYPE or val.dtype != bits.dtype
                or counts.shape != (n_chunks,) or val.shape != local.shape or int(counts.sum()) != local.size):
            raise WeightFormatError(f"{where}: the element delta of {name} does not fit the array")
        idx = (np.repeat(np.arange(n_chunks, dtype=np.int64), counts) << CHUNK_BITS) | local
        if idx.size and int(idx.max()) >= bits.size:
            raise WeightFormatError(f"{where}: the element delta of {name} does not fit the array")
        bits[idx] = val
        return new
    if encoding == "ulps":
        gaps, steps, val = data
        if gaps.dtype != GAP_DTYPE or steps.dtype != ULP_DTYPE or val.dtype != bits.dtype or gaps.ndim != 1:
            raise WeightFormatError(f"{where}: the ulps delta of {name} has {gaps.dtype.name}/{steps.dtype.name}/"
                                    f"{val.dtype.name} leaves")
        filler = gaps == 0
        idx = np.cumsum(np.where(filler, GAP_DTYPE.type(GAP_MAX), gaps), dtype=np.int64)
        idx -= 1
        if filler.any():
            idx = idx[~filler]
        escaped = steps == ESCAPE
        if (steps.shape != idx.shape or val.shape != (int(escaped.sum()),)
                or (idx.size and int(idx[-1]) >= bits.size)):
            raise WeightFormatError(f"{where}: the ulps delta of {name} does not fit the array")
        bits[idx] += steps.astype(_INT[bits.itemsize]).view(bits.dtype)  # wraps as encoded; ESCAPE adds 0
        bits[idx[escaped]] = val
        return new
    idx, val = data
    if idx.dtype != INDEX_DTYPE or val.dtype != bits.dtype:
        raise WeightFormatError(f"{where}: {encoding} of {name} has index {idx.dtype.name}, values {val.dtype.name}")
    n_full = bits.size // block
    if val.shape != (idx.size, block) or (idx.size and int(idx.max()) > n_full - (bits.size % block == 0)):
        raise WeightFormatError(f"{where}: block delta of {name} does not fit the array")
    inner = idx < n_full
    bits[: n_full * block].reshape(-1, block)[idx[inner]] = val[inner]
    if not inner.all():
        tail = bits[n_full * block:]
        tail[:] = val[-1, : tail.size]
    return new
