"""`marinrl train CONFIG` started as a terminal starts it, and the processes it leaves behind: the one way the
job-level process tests (tests/test_job_faults.py, tests/test_openenv.py) start, watch and stop a whole job,
and the polls and process checks they and tests/test_reaper.py share."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

WAIT_S = 900.0
"""How long a test waits for a job to get somewhere (a checkpoint, a step, its rollouts): long enough for a
cold compile cache on a machine loaded many times over (three suites at once, load 8–13, missed 150 s), shorter
than the files' timeout, which names a job that hangs."""

_JOB = """
run_id: job
run_root: {root}
model:
  model: {{type: llama, seq_len: 32, hidden_dim: 32, intermediate_dim: 64, num_layers: 2, num_heads: 2,
          num_kv_heads: 2, gradient_checkpointing: false, scan_layers: false}}
  vocab_size: 512
curriculum:
  lessons:
{lesson}
num_train_steps: 100000
groups_per_step: 4
n_generations: 4
eval_every: 100000
eval_examples: 4
batching: {{max_length: 32, min_bucket: 8}}
"""

# As a terminal's foreground command: SIGINT at its default (a shell's background job, CI under `cmd &`,
# inherits it ignored), set before exec rather than in a preexec_fn (a fork of this process, which runs
# JAX's threads).
_TRAIN = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
          "os.execv(sys.executable, [sys.executable, '-m', 'marinrl.cli', 'train', sys.argv[1]])")


def endless_job(root: pathlib.Path, lesson: str, extra: str = "") -> str:
    """The YAML of a tiny job under `root` that trains until stopped; `lesson`: the one lesson's YAML (a list
    item, indented 4); `extra`: more top-level YAML."""
    return _JOB.format(root=root, lesson=lesson) + extra


def poll(condition: Callable[[], object], what: str, deadline_s: float = WAIT_S,
         ended: Optional[Callable[[], Optional[str]]] = None):
    """Polls until `condition()` is true and returns its value. `ended()`: why waiting on is pointless (the
    job ended already), or None; then it fails at once, naming how, rather than as a wait that ran out."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        outcome = ended() if ended is not None else None
        if outcome is not None:
            raise AssertionError(f"the job ended before {what}: {outcome}")
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {deadline_s:.0f}s waiting for {what}")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc), zombies excluded."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


class TrainCommand:
    """`marinrl train CONFIG` in a session of its own, its output in `log`. As a context manager: whatever
    is still running of its process group at the end is killed."""

    def __init__(self, config: pathlib.Path, log: pathlib.Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAIN, str(config)], stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})

    def output(self) -> str:
        return self.log.read_text()

    def running_once(self, condition: Callable[[], object], what: str) -> set[int]:
        """Waits for `condition()` while the command runs (one that ended fails, with its output's tail), then
        returns the processes it has started."""
        poll(lambda: self.proc.poll() is not None or condition(), what)
        assert self.proc.poll() is None, self.output()[-3000:]
        return descendants(self.proc.pid)

    def interrupt(self, timeout_s: float) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to the whole process group; then waits for the command."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout=timeout_s)

    def __enter__(self) -> TrainCommand:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def all_exit(started: set[int], what: str = "every process the job started to exit") -> None:
    """Waits (30 s) until none of `started` runs."""
    poll(lambda: not any(alive(p) for p in started), what, deadline_s=30)
