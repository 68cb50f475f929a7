"""An environment for the in-flight RLJob test, importable by dotted path from Ray actors
(`EnvConfig("inflight_envs:WaitsForNewWeights", {...})` with tests/ on PYTHONPATH, as
tests/faulty_envs.py)."""

from __future__ import annotations

import json
import os
import threading
import time

from marinrl.envs import Feedback, MultiTurnEnv, Problem


class WaitsForNewWeights(MultiTurnEnv):
    """Two turns; between them a training episode waits until the trainer has published weights newer
    than the ones it began with (read from the filesystem transfer's `latest.json`), so the second
    turn is sampled by newer weights than the first: every training batch but the first spans a
    swap, deterministically. Reward 1 on a first turn that starts with 'a'. The first training call
    does not wait: the trainer needs that batch before it can publish anything."""

    env_name = "waits_for_new_weights"
    max_turns = 2
    max_episode_tokens = 12

    def __init__(self, weights_root: str, timeout_s: float = 120.0):
        self.pointer = os.path.join(weights_root, "latest.json")
        self.timeout_s = timeout_s
        self._train_calls = 0
        self._mode = "eval"
        self._began_with: int | None = None

    def _published(self) -> int:
        with open(self.pointer) as f:
            return int(json.load(f)["weight_step"])

    def sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        self._mode = mode
        self._train_calls += mode == "train"
        self._began_with = self._published() if mode == "train" else None
        return super().sample(ctx, n_examples, n_generations, sampling, rng, mode)

    def problems(self, n, rng, mode):
        return [Problem(prompt="go", answer="a", example_id=str(i)) for i in range(n)]

    def step(self, problem, actions):
        if len(actions) == 1:
            if self._mode == "train" and self._train_calls > 1:
                deadline = time.monotonic() + self.timeout_s
                wake = threading.Event()
                while self._published() <= self._began_with and time.monotonic() < deadline:
                    wake.wait(0.02)  # polls a condition: the trainer's next publish
            return Feedback(reward=float(actions[0].startswith("a")), observation="!")
        return Feedback(reward=0.0, done=True)
