"""What the driver shows on the terminal while a job runs: the trainer's progress bar, and the rollout workers'
waits on environment servers that do not answer."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import ray

STALL_NOTICE_S = 15.0
"""A rollout worker's wait on an environment server (a session, a step) is printed once it is this old."""


class StallNotices:
    """The rollout workers' overdue waits on environment servers (`RolloutActor.waits`), printed on the
    terminal: a server that accepts and never answers is seen in seconds, not after minutes of retries
    in a log file. Each wait once, then once a minute while it lasts. Polls without blocking the job."""

    def __init__(self, every_s: float = 5.0, repeat_s: float = 60.0):
        self._every_s, self._repeat_s = every_s, repeat_s
        self._asked = -math.inf
        self._pending: dict[Any, int] = {}  # a `waits` call in flight -> its worker's index
        self._shown: dict[str, float] = {}

    def poll(self, rollouts: list) -> None:
        done = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)[0] if self._pending else []
        for ref in done:
            i = self._pending.pop(ref)
            try:
                overdue = ray.get(ref)
            except Exception:  # a worker that died: the job restarts it and says so
                continue
            for line in self.lines(i, overdue, time.monotonic()):
                ProgressBar.write(line)
        now = time.monotonic()
        if now - self._asked >= self._every_s:
            self._asked = now
            busy = set(self._pending.values())
            for i, actor in enumerate(rollouts):
                if i not in busy:  # one call at a time per worker: one still starting does not pile them up
                    self._pending[actor.waits.remote(STALL_NOTICE_S)] = i

    def lines(self, worker: int, overdue: list[str], now: float) -> list[str]:
        out = []
        for what in overdue:
            key = f"{worker}:{what.split(': no answer for ')[0]}"
            if now - self._shown.get(key, -math.inf) >= self._repeat_s:
                self._shown[key] = now
                out.append(f"[marinrl] rollout worker {worker} is waiting: {what} (its log: logs/rollout-{worker}.log)")
        return out


class ProgressBar:
    """The trainer's step, train reward and step time, polled from its actor."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
        self.answered = False
        """Whether the trainer has answered: its actor is built (Ctrl-C waits for its answer to `stop`)."""

    def update(self, trainer) -> None:
        try:
            p = ray.get(trainer.progress.remote(), timeout=2.0)
        except Exception:  # compiling, or gone: the main loop notices the latter
            return
        self.answered = True
        self._bar.update(p["step"] - self._bar.n)
        if "batch/reward_mean" in p:
            self._bar.set_postfix(reward=f"{p['batch/reward_mean']:.2f}", step_s=f"{p['train/step_s']:.2f}",
                                  stale=f"{p['batch/staleness_mean']:.1f}", refresh=False)

    def close(self) -> None:
        self._bar.close()

    @staticmethod
    def write(line: str) -> None:
        """A line on stderr above the bar."""
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
