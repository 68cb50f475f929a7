"""One process of the verifiers bridge (`verifiers_bridge.py`, run by verifiers' own interpreter): JSON lines in
and out, each answer matched to its request by id on a reader thread (docs/environments.md, "verifiers")."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

WAIT_NOTICE_S = 10.0
"""Seconds the check before a job waits on `python` in silence: then the terminal says what it waits for (and
again every `WAIT_NOTICE_REPEAT_S`), so a `python` that hangs is seen at once, not after its whole timeout."""
WAIT_NOTICE_REPEAT_S = 30.0


class BridgeDied(RuntimeError):
    """The bridge or the EnvServer process ended; the episodes it held may run again."""


def run_noticed(argv: list[str], timeout: float, what: str,
                notice_s: float = WAIT_NOTICE_S) -> tuple[Optional[int], str, str]:
    """(exit status, stdout, stderr) of `argv` run to its end; the status is None when it ran past `timeout`
    seconds. Prints `[marinrl] waiting for <what>` on stderr once it has run `notice_s` seconds, and every
    `WAIT_NOTICE_REPEAT_S` after. It runs in a session of its own, killed with every process it started when it
    runs out of time or the caller is interrupted (Ctrl-C reaches only the caller)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    started = time.monotonic()
    notice_at = notice_s
    try:
        while True:
            elapsed = time.monotonic() - started
            try:
                out, err = proc.communicate(timeout=max(0.0, min(timeout, notice_at) - elapsed))
                return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                if elapsed >= timeout:
                    _kill_session(proc)
                    out, err = proc.communicate()
                    return None, out.decode(errors="replace"), err.decode(errors="replace")
                if elapsed >= notice_at:
                    print(f"[marinrl] waiting for {what}: no answer for {elapsed:.0f} s (up to {timeout:g} s)",
                          file=sys.stderr, flush=True)
                    notice_at += WAIT_NOTICE_REPEAT_S
    except BaseException:
        _kill_session(proc)
        raise


def _kill_session(proc: subprocess.Popen) -> None:
    """Kills `proc` and its children (which hold its pipes open), all in the session it leads."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def last_words(stdout: str, stderr: str, n: int = 800) -> str:
    """What a process that failed printed, as one line: its stderr's tail, else its stdout's, else that it
    printed nothing."""
    for text, where in ((stderr, ""), (stdout, "on stdout: ")):
        text = " ".join(text.split())
        if text:
            return where + text[-n:]
    return "it printed nothing"


def tail(path: Optional[str], n: int = 1500) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        text = f.read()[-n:]
    return " ".join(text.split())


class BridgeProcess:
    """One bridge process: JSON lines in and out, answers matched to requests by id on a reader thread."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str, what: str):
        self.what = what
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._first: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"marinrl-{what}")
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if not self._first.done():
                self._first.set_result(line)
                continue
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._lock:
                future = self._pending.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        self.proc.wait()
        error = BridgeDied(f"the verifiers {self.what} exited ({self.proc.returncode}): {tail(self.log_path)}")
        if not self._first.done():
            self._first.set_exception(error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def first_line(self, timeout: float) -> str:
        """The process's first line of output (its announcement), waited for up to `timeout` seconds."""
        try:
            return self._first.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the verifiers {self.what} did not start within {timeout:g} s: "
                               f"{tail(self.log_path)}") from None

    def request(self, **message) -> concurrent.futures.Future:
        with self._lock:
            self._next += 1
            rid = self._next
            future: concurrent.futures.Future = concurrent.futures.Future()
            if self.proc.poll() is not None:
                future.set_exception(BridgeDied(f"the verifiers {self.what} is not running"))
                return future
            self._pending[rid] = future
        try:
            self.proc.stdin.write((json.dumps({"id": rid, **message}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the reader fails the future when the process is gone
        return future

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        try:
            self.proc.stdin.close()  # the bridge ends on EOF
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
