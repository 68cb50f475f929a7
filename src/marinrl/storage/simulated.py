"""A filesystem that counts every storage request and can make each one cost what it costs on GCS.

`SimulatedStore` wraps a real fsspec filesystem (memory by default; local disk or the GCS emulator work
too) and forwards the calls rollout files, weight versions and the curriculum state make (`ls`,
`cat_file`, `pipe_file`, `open`, `rm`, `mv`, `info`, `exists`), after

- counting the request in its `RequestStats` by kind (list, read, write, delete, other) and by the
  label a `labeler(path)` gives (`bench/fleet.py`: rollouts, weights, pointer, curriculum), with the
  bytes it moved; a listing counts one request per 1,000 names (GCS's page);
- sleeping `latency_s` (the request's round trip), then the transfer time: `bytes / stream_bytes_per_s`
  for the connection, and FIFO on one shared link of `total_bytes_per_s` (a transfer starts when the
  link has finished the bytes queued before it);
- `byte_scale` (label → factor): the bytes of a label are charged and counted that many times over,
  so that small real objects stand for large ones (`bench/fleet.py` moves real weight versions of a few
  MB and charges them as the 1.2 GB they stand for).

Use it through a URL (`simstore://bucket/run`, storage options `{"latency_s": 0.03, "stats": stats}`)
wherever the product takes one, or hand an instance as `fs=`. Options that must cross a process boundary
(a Ray actor's config) are plain data: `inner="gcs"` with `inner_options` (`{"endpoint_url": …}` for the
GCS emulator), `stats="name"` for this process's `RequestStats.named(name)` (every store of the process
given that name counts into one), `labeler="role"` for `label_by_role`. Tests count requests with it; they
never assert time. `bench/fleet.py` and docs/scaling.md ("A fleet of rollout hosts") use both.
"""

from __future__ import annotations

import collections
import io
import math
import threading
import time
from typing import Callable

import fsspec
import numpy as np
from fsspec.spec import AbstractFileSystem

PROTOCOL = "simstore"
LIST_PAGE = 1000
"""Names per listing request (GCS pages object listings at 1,000)."""


def label_by_role(path: str) -> str:
    """A run's storage by role: `rollouts`, `pointer` (a weight stream's latest.json), `weights`, `other`."""
    if "/rollouts" in path:
        return "rollouts"
    if path.endswith("latest.json"):
        return "pointer"
    if "/weights" in path:
        return "weights"
    return "other"


LABELERS: dict[str, Callable[[str], str]] = {"role": label_by_role}
_NAMED: dict[str, RequestStats] = {}
_NAMED_LOCK = threading.Lock()


class RequestStats:
    """Thread-safe request and byte counts by (kind, label)."""

    @staticmethod
    def named(name: str, labeler: Callable[[str], str] | None = None) -> RequestStats:
        """This process's counts of that name (made on first use with `labeler`: give the same one every time)."""
        with _NAMED_LOCK:
            if name not in _NAMED:
                _NAMED[name] = RequestStats(labeler)
            return _NAMED[name]

    def __init__(self, labeler: Callable[[str], str] | None = None):
        self.labeler = labeler or (lambda path: "")
        self._lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        """The most requests that were waiting out their cost at once (how concurrent a caller is)."""

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def add(self, kind: str, path: str, n: int = 1, nbytes: int = 0) -> None:
        key = (kind, self.labeler(path))
        with self._lock:
            self.requests[key] += n
            self.bytes[key] += nbytes

    def snapshot(self) -> tuple[dict, dict]:
        with self._lock:
            return dict(self.requests), dict(self.bytes)

    def total(self, kind: str | None = None, label: str | None = None) -> int:
        with self._lock:
            return sum(v for (k, lab), v in self.requests.items()
                       if (kind is None or k == kind) and (label is None or lab == label))

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes.clear()
            self.max_in_flight = self.in_flight


class _Link:
    """One shared link: transfers queue FIFO at `bytes_per_s`."""

    def __init__(self, bytes_per_s: float | None):
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def done_at(self, nbytes: int, now: float) -> float:
        if not self.bytes_per_s:
            return now
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at


class SimulatedStore(AbstractFileSystem):
    protocol = PROTOCOL
    cachable = False

    def __init__(self, inner: str | AbstractFileSystem = "memory", latency_s: float = 0.0,
                 stream_bytes_per_s: float | None = None, total_bytes_per_s: float | None = None,
                 stats: RequestStats | str | None = None, link: _Link | None = None,
                 byte_scale: dict[str, float] | None = None, inner_options: dict | None = None,
                 labeler: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.inner = fsspec.filesystem(inner, **(inner_options or {})) if isinstance(inner, str) else inner
        if labeler is not None and labeler not in LABELERS:
            raise ValueError(f"SimulatedStore labeler must be one of {sorted(LABELERS)}, got {labeler!r}")
        if isinstance(stats, str):
            stats = RequestStats.named(stats, LABELERS[labeler] if labeler else None)
        self.protocol = (PROTOCOL, *[str(p) for p in np.atleast_1d(self.inner.protocol)])
        self.latency_s = latency_s
        self.stream_bytes_per_s = stream_bytes_per_s
        self.link = link or _Link(total_bytes_per_s)
        self.stats = stats if stats is not None else RequestStats()
        self._strip_protocol = self._strip_inner
        self.byte_scale = byte_scale or {}

    # ---------------------------------------------------------------- the cost of a request

    def _cost(self, kind: str, path: str, nbytes: int = 0, n: int = 1) -> None:
        if nbytes and self.byte_scale:
            nbytes = int(nbytes * self.byte_scale.get(self.stats.labeler(path), 1.0))
        self.stats.add(kind, path, n, nbytes)
        wait = self.latency_s * n
        if nbytes:
            now = time.monotonic()
            stream = now + nbytes / self.stream_bytes_per_s if self.stream_bytes_per_s else now
            wait += max(stream, self.link.done_at(nbytes, now)) - now
        self.stats.enter()
        try:
            if wait > 0:
                time.sleep(wait)
        finally:
            self.stats.leave()

    # ---------------------------------------------------------------- paths

    @classmethod
    def _strip_protocol(cls, path):  # fsspec's URL parsing (an instance replaces it with `_strip_inner`)
        path = str(path)
        return path[len(PROTOCOL) + 3:] if path.startswith(f"{PROTOCOL}://") else path

    def _strip_inner(self, path):
        """A path as the inner filesystem names it."""
        if isinstance(path, list):
            return [self._strip_inner(p) for p in path]
        return self.inner._strip_protocol(SimulatedStore._strip_protocol(path))

    def unstrip_protocol(self, name: str) -> str:
        return self.inner.unstrip_protocol(name)

    def invalidate_cache(self, path=None):
        self.inner.invalidate_cache(path)

    # ---------------------------------------------------------------- requests

    def ls(self, path, detail=True, **kwargs):
        try:
            out = self.inner.ls(path, detail=detail, **kwargs)
        except FileNotFoundError:
            self._cost("list", path)
            raise
        self._cost("list", path, n=max(1, math.ceil(len(out) / LIST_PAGE)))
        return out

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = self.inner.cat_file(path, start=start, end=end, **kwargs)
        self._cost("read", path, len(data))
        return data  # (an in-memory inner holds the bytes anyway: reading first costs no memory)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        self._cost("write", path, len(value))
        return self.inner.pipe_file(path, value, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        return _WriteBuffer(self, path)

    def info(self, path, **kwargs):
        self._cost("other", path)
        return self.inner.info(path, **kwargs)

    def exists(self, path, **kwargs):
        self._cost("other", path)
        return self.inner.exists(path, **kwargs)

    def makedirs(self, path, exist_ok=False):
        return self.inner.makedirs(path, exist_ok=exist_ok)  # object stores have no folders: no request

    def mkdir(self, path, create_parents=True, **kwargs):
        return self.inner.mkdir(path, create_parents=create_parents, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        files = self.inner.find(path) if recursive else [path]
        self._cost("list", path)
        self._cost("delete", path, n=max(1, len(files)))
        return self.inner.rm(path, recursive=recursive, maxdepth=maxdepth)

    def mv(self, path1, path2, **kwargs):
        self._cost("write", path2, n=2)  # a copy and a delete
        return self.inner.mv(path1, path2, **kwargs)


class _WriteBuffer(io.BytesIO):
    """`open(path, "wb")`: one write request of the whole object when closed."""

    def __init__(self, fs: SimulatedStore, path: str):
        super().__init__()
        self._fs, self._path = fs, path

    def close(self):
        if not self.closed:
            self._fs.pipe_file(self._path, self.getvalue())
        super().close()


fsspec.register_implementation(PROTOCOL, SimulatedStore, clobber=True)
