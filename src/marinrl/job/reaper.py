"""The job's processes die with its driver: a watchdog for the local Ray a job starts (`RLJob`, no
`ray.address`).

Ray ties its head processes (GCS, raylet, monitors) to the driver that started them with the kernel's
parent-death signal, and the actors' workers end once their raylet is gone (about 2 s, during which a
trainer keeps training and may write a checkpoint). Ray's two agents (the dashboard and runtime-env
agents, about 217 MB) see their raylet die at once but then try to report it to the dead GCS for 60 s
before they exit. After `kill -9` of the driver, nothing of Ray's own ends them sooner.

So the driver marks every process of its Ray: `MARINRL_RAY_OWNER=<token>` is in the environment Ray's
processes start with (the driver's own environment while `ray.init` runs; every worker, agent and
process an actor starts inherits it). This watchdog, started by the driver before `ray.init`, reads a
pipe from the driver and, once a second, notes the job's processes: the marked ones and their
descendants (`JobProcesses`: Ray's agents and workers retitle themselves, which can overwrite the mark).
When the driver ends (exit, crash, `kill -9`: the kernel closes the pipe), it SIGKILLs every one of them
still alive, until none is left, and exits.
The driver stops it after `ray.shutdown` (a write, then the pipe closed): it sweeps what is left, if
anything, without a word.

Run as a script (`python -I reaper.py <driver pid> <token>`): the standard library only, never marinrl
or Ray (a few MB of memory for the job's lifetime).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import Iterator, Optional

OWNER_ENV = "MARINRL_RAY_OWNER"
"""The environment variable that marks a process as one of a job's local Ray."""


def job_processes(token: str, exclude: tuple[int, ...] = ()) -> Iterator[int]:
    """The pids of this user's processes whose environment holds `OWNER_ENV=token` (from /proc). A process
    that retitles itself (Ray's agents and workers: `ray::…`) may have overwritten the start of its
    environment, the mark with it: `JobProcesses` finds those as descendants."""
    mark = f"{OWNER_ENV}={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or another user's
            continue
        if mark in environ:
            yield int(entry)


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, state) of every process (/proc/<pid>/stat)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(entry)] = (int(fields[1]), fields[19], fields[0])
    return out


class JobProcesses:
    """The job's processes as last seen: the marked ones and every descendant of them (Ray's GCS and raylet
    keep their environment; the agents and workers the raylet starts are its children), each with its start
    time, so that a process that was seen is found after its parent died and it was handed to init, and a
    reused pid is not."""

    def __init__(self, token: str, exclude: tuple[int, ...] = ()):
        self.token = token
        self.exclude = (os.getpid(), *exclude)
        self.seen: dict[int, str] = {}

    def look(self) -> list[int]:
        """Updates `seen`; returns the pids of the job's live processes (zombies excluded)."""
        table = _processes()
        seen = {pid: start for pid, start in self.seen.items() if pid in table and table[pid][1] == start}
        for pid in job_processes(self.token, self.exclude):
            if pid in table:
                seen[pid] = table[pid][1]
        children: dict[int, list[int]] = {}
        for pid, (parent, _, _) in table.items():
            children.setdefault(parent, []).append(pid)
        todo = list(seen)
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in seen and child not in self.exclude:
                    seen[child] = table[child][1]
                    todo.append(child)
        self.seen = seen
        return [pid for pid in seen if table[pid][2] != "Z"]

    def kill_all(self, rounds: int = 20) -> int:
        """SIGKILLs the job's processes until a look finds none (a raylet killed while it starts a worker may
        leave that one behind: the next look finds it). Returns how many were killed."""
        killed: set[int] = set()
        for _ in range(rounds):
            found = self.look()
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except OSError:
                    pass
            time.sleep(0.1)
        return len(killed)


LOOK_EVERY_S = 1.0
"""How often the watchdog looks at the job's processes while the driver lives."""


class Reaper:
    """The driver's side: `start()` before `ray.init`, `ray.init` inside `marked()`, `stop()` after
    `ray.shutdown`."""

    def __init__(self, token: Optional[str] = None):
        self.token = token or uuid.uuid4().hex
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """The watchdog, its stdin the read end of a pipe only this process writes (the write end is not
        inherited by anything this process starts later), in a session of its own: the terminal's Ctrl-C
        and a signal to the driver's process group are the driver's to handle, not its."""
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), self.token],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
                                      start_new_session=True)

    @contextlib.contextmanager
    def marked(self) -> Iterator[None]:
        """This process's environment holds the mark while the block runs (`ray.init`: what it starts
        inherits the mark, and what those start)."""
        saved = os.environ.get(OWNER_ENV)
        os.environ[OWNER_ENV] = self.token
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(OWNER_ENV, None)
            else:
                os.environ[OWNER_ENV] = saved

    def stop(self, timeout_s: float = 10.0) -> None:
        """Closes the pipe: the watchdog sweeps what is left of the job's processes (quietly: this is no
        driver's death) and exits."""
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(b"stop")
            self._proc.stdin.close()
            self._proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._proc = None


def main(argv: list[str]) -> int:
    driver, token = int(argv[1]), argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job = JobProcesses(token, exclude=(driver,))
    stopped = False  # the driver writes once, when it stops this watchdog after `ray.shutdown`
    while True:
        if select.select([0], [], [], LOOK_EVERY_S)[0]:
            if not os.read(0, 4096):  # the pipe closed: stopped, or the driver is gone
                break
            stopped = True
        else:
            job.look()
    n = job.kill_all()
    if n and not stopped:
        print(f"[marinrl] the job's driver ended: killed {n} processes of its local Ray", file=sys.stderr,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
