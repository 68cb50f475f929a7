"""The packed weight format: all array leaves of a model in one object, no pickle.

    MAGIC (8 bytes) | header length (8 bytes, little-endian) | header (JSON, UTF-8) | padding | data

The header is `{"format_version": 1, "leaves": [{"name", "dtype", "shape", "offset", "nbytes"}]}`, plus
`"meta"` (any JSON: the delta header of transfer/delta.py) when the writer gives one;
offsets count from the start of the data, which begins (and every leaf begins) on a 64-byte
boundary. Leaves are stored C-contiguous in native little-endian order; `dtype` is a NumPy/JAX
dtype name (`float32`, `bfloat16`, ...). Written in one pass with a CRC-32 of every byte, read back
as zero-copy NumPy views of the object's bytes.
"""

from __future__ import annotations

import json
import sys
import zlib
from typing import BinaryIO, Sequence

import jax.numpy as jnp
import numpy as np

from marinrl.transfer.base import WeightFormatError

MAGIC = b"marinrlW"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = len(MAGIC) + 8

if sys.byteorder != "little":  # pragma: no cover - every host we run on is little-endian
    raise ImportError("the packed weight format assumes a little-endian host")


def _pad(n: int) -> int:
    return -n % ALIGN


def write_packed(f: BinaryIO, names: Sequence[str], arrays: Sequence[np.ndarray],
                 meta: dict | None = None) -> tuple[int, int]:
    """Writes the leaves (and `meta`, if given) to the binary file `f`; returns (bytes written, CRC-32)."""
    leaves, offset = [], 0
    for name, a in zip(names, arrays, strict=True):
        leaves.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset,
                       "nbytes": a.nbytes})
        offset += a.nbytes + _pad(a.nbytes)
    header = {"format_version": FORMAT_VERSION, "leaves": leaves}
    if meta is not None:
        header["meta"] = meta
    header = json.dumps(header).encode()
    crc, total = 0, 0

    def put(buf) -> None:
        nonlocal crc, total
        f.write(buf)
        crc = zlib.crc32(buf, crc)
        total += len(buf)

    put(MAGIC + len(header).to_bytes(8, "little") + header + bytes(_pad(_PREFIX + len(header))))
    for a in arrays:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        put(memoryview(flat))
        put(bytes(_pad(a.nbytes)))
    return total, crc


def read_packed(data: bytes, where: str, *, expected_bytes: int | None = None,
                expected_crc: int | None = None) -> tuple[list[str], list[np.ndarray]]:
    """Parses packed bytes into (names, read-only NumPy views); raises WeightFormatError naming `where`."""
    _, names, arrays = read_packed_meta(data, where, expected_bytes=expected_bytes, expected_crc=expected_crc)
    return names, arrays


def read_packed_meta(data: bytes, where: str, *, expected_bytes: int | None = None,
                     expected_crc: int | None = None) -> tuple[dict | None, list[str], list[np.ndarray]]:
    """Like `read_packed`, with the header's `meta` (None if it has none) first."""
    if expected_bytes is not None and len(data) != expected_bytes:
        raise WeightFormatError(f"{where}: {len(data)} bytes, the pointer says {expected_bytes}")
    if expected_crc is not None and zlib.crc32(data) != expected_crc:
        raise WeightFormatError(f"{where}: CRC-32 mismatch, the data is corrupt")
    if len(data) < _PREFIX or data[: len(MAGIC)] != MAGIC:
        raise WeightFormatError(f"{where}: not a packed weight file (bad magic)")
    header_len = int.from_bytes(data[len(MAGIC):_PREFIX], "little")
    try:
        header = json.loads(data[_PREFIX:_PREFIX + header_len])
        version = int(header["format_version"])
        leaves = header["leaves"]
        meta = header.get("meta")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightFormatError(f"{where}: unreadable header ({e!r})") from e
    if version != FORMAT_VERSION:
        raise WeightFormatError(f"{where}: format version {version}, this reader knows {FORMAT_VERSION}")
    start = _PREFIX + header_len + _pad(_PREFIX + header_len)
    names, arrays = [], []
    for leaf in leaves:
        try:
            name, dtype, shape = str(leaf["name"]), jnp.dtype(leaf["dtype"]), tuple(int(d) for d in leaf["shape"])
            offset, nbytes = int(leaf["offset"]), int(leaf["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightFormatError(f"{where}: bad leaf entry {leaf!r:.200} ({e!r})") from e
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize != nbytes or offset < 0 or start + offset + nbytes > len(data):
            raise WeightFormatError(f"{where}: leaf {name} does not fit in the data ({len(data)} bytes)")
        if count == 0:
            arrays.append(np.zeros(shape, dtype))
        else:
            arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=start + offset).reshape(shape))
        names.append(name)
    return meta, names, arrays
