"""Logging that a failing run cannot flood, and that lands in the run folder.

`ENV_ERRORS.report` logs each *distinct* error once with its traceback, then its repeats as one line
with a count at the 2nd, 4th, 8th, ... occurrence: an environment failing on every call costs a
handful of lines, not a traceback per try. `log_to_file` copies an actor's log records to
`<run_dir>/logs/<role>.log` (or, for a remote run_dir, to a local `logs/<run_id>/<role>.log`).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import re
import threading
import time
from typing import Optional, Sequence

import fsspec

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _normalized(text: str) -> str:
    """What makes two errors the same: their text with numbers and hex ids blanked (a group index or
    a uuid in a message does not make an error new)."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", text)[:500]


class DistinctErrors:
    """Counts errors by their normalized text; logs the first occurrence of each in full and its
    repeats as counts. `last()` is the last error this thread reported: the exception as
    `Type: message` where there is one, else the description."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._texts: dict[tuple[str, str], str] = {}
        self._local = threading.local()

    def report(self, log: logging.Logger, what: str, exc: Optional[BaseException] = None, *,
               level: int = logging.ERROR, traceback: bool = True) -> int:
        """Log `what` (and `exc`) unless it is a repeat; returns how often it has been seen."""
        text = f"{what}: {type(exc).__name__}: {exc}" if exc is not None else what
        key = (log.name, _normalized(text))
        with self._lock:
            n = self._counts[key] = self._counts.get(key, 0) + 1
            self._texts.setdefault(key, text)
        self._local.last = f"{type(exc).__name__}: {exc}" if exc is not None else what
        if n == 1:
            log.log(level, "%s", text, exc_info=exc if traceback and exc is not None else None)
        elif n & (n - 1) == 0:  # a power of two: a bounded number of lines however long it goes on
            log.log(level, "%s [seen %d times so far; the first one is logged in full above]", text, n)
        return n

    def last(self) -> Optional[str]:
        return getattr(self._local, "last", None)

    def forget_last(self) -> None:
        self._local.last = None

    def summary(self) -> list[tuple[str, int]]:
        """(first text, count) of every distinct error, most frequent first."""
        with self._lock:
            return sorted(((self._texts[k], n) for k, n in self._counts.items()), key=lambda t: -t[1])

    def log_summary(self, log: logging.Logger) -> None:
        for text, n in self.summary():
            log.error("failure summary: %d x %s", n, text)


ENV_ERRORS = DistinctErrors()
"""The process's record of environment and rollout failures (one per Ray actor process)."""


class Waits:
    """What this process is waiting on now (a session, a connection, a server's answer). An actor's log is a
    file nobody watches: the job's driver asks each rollout worker for `overdue` waits and prints them on the
    terminal, so a server that accepts and never answers is seen within seconds, not after every retry."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[int, tuple[str, float]] = {}
        self._next = 0

    @contextlib.contextmanager
    def waiting(self, what: str):
        """Marks `what` (where, on what, its deadline) as awaited for the block's duration."""
        with self._lock:
            key = self._next = self._next + 1
            self._open[key] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                del self._open[key]

    def overdue(self, after_s: float) -> list[str]:
        """One line per distinct wait older than `after_s`: what, how many, the oldest's age."""
        now = time.monotonic()
        oldest: dict[str, float] = {}
        counts: dict[str, int] = {}
        with self._lock:
            for what, since in self._open.values():
                if now - since >= after_s:
                    oldest[what] = max(oldest.get(what, 0.0), now - since)
                    counts[what] = counts.get(what, 0) + 1
        return [f"{what}: no answer for {oldest[what]:.0f} s"
                + (f" ({counts[what]} waiting)" if counts[what] > 1 else "") for what in sorted(oldest)]


WAITS = Waits()
"""The process's open waits on environment servers (one per Ray actor process)."""


def overdue_waits(after_s: float) -> list[str]:
    """`WAITS.overdue(after_s)`, as a function: an actor method refers to it by name (Ray pickles the
    actor's class, and a lock held by value would not pickle)."""
    return WAITS.overdue(after_s)


def local_log_dir(run_dir: str, run_id: str) -> pathlib.Path:
    """`<run_dir>/logs` when the run folder is local; a local `logs/<run_id>` (absolute) otherwise:
    log files are appended line by line, which object stores cannot do."""
    protocol = fsspec.utils.get_protocol(run_dir)
    if protocol in ("file", "local"):
        return pathlib.Path(fsspec.core.strip_protocol(run_dir)).resolve() / "logs"
    return (pathlib.Path("logs") / run_id).resolve()


def log_to_file(log_dir: str | pathlib.Path, role: str, loggers: Sequence[str] = ("",)) -> pathlib.Path:
    """Append the records of `loggers` (default: the root logger) at INFO and above to
    `<log_dir>/<role>.log`; marinrl's own INFO records are let through. Idempotent per file.

    Name loggers (e.g. "marinrl", "levanter") rather than the root where a library reconfigures the
    root logger (Levanter's `basicConfig(force=True)` removes the root's handlers)."""
    path = (pathlib.Path(log_dir) / f"{role}.log").resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    marinrl = logging.getLogger("marinrl")
    if marinrl.level == logging.NOTSET or marinrl.level > logging.INFO:
        marinrl.setLevel(logging.INFO)
    for name in loggers:
        target = logging.getLogger(name)
        if any(getattr(h, "baseFilename", None) == str(path) for h in target.handlers):
            continue
        handler = logging.FileHandler(path, mode="a")
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        target.addHandler(handler)
    return path


def log_actor_to_file(actor, log_dir: str, role: str) -> None:
    """`log_to_file(log_dir, role)`, run inside an actor through `actor.__ray_call__.remote(log_actor_to_file,
    ...)`. It lives here, not in marinrl/job/rl_job.py, because Ray imports a function's module in the actor
    before calling it: from here the curriculum actor imports this light module, not the job's (Levanter,
    transformers), and the trainer and rollout actors the job starts after it begin seconds earlier."""
    log_to_file(log_dir, role)
