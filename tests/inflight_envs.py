"""Environments for the in-flight RLJob tests, importable by dotted path from Ray actors
(`EnvConfig("inflight_envs:WaitsForNewWeights", {...})` with tests/ on PYTHONPATH, as
tests/faulty_envs.py)."""

from __future__ import annotations

import json
import os
import threading
import time

from marinrl.envs import Feedback, MultiTurnEnv, Problem
from marinrl.envs.toy import EchoEnv, grade_answer


class _WaitsBetweenTurns(MultiTurnEnv):
    """Two turns; after the first, a training episode (from the second training call on) waits until the
    trainer has published weights newer than the ones the call began with (read from the filesystem
    transfer's `latest.json`), so its second turn is sampled by newer weights than its first."""

    max_turns = 2

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

    def wait_for_newer_weights(self) -> None:
        """The first training call does not wait: the trainer needs that batch before it publishes anything."""
        if self._mode != "train" or self._train_calls <= 1:
            return
        deadline = time.monotonic() + self.timeout_s
        wake = threading.Event()
        while self._published() <= self._began_with and time.monotonic() < deadline:
            wake.wait(0.02)  # polls a condition: the trainer's next publish


class WaitsForNewWeights(_WaitsBetweenTurns):
    """Every training batch but the first spans a swap, deterministically. Reward 1 on a first turn that
    starts with 'a'."""

    env_name = "waits_for_new_weights"
    max_episode_tokens = 12

    def problems(self, n, rng, mode):
        return [Problem(prompt="go", answer="a", example_id=str(i)) for i in range(n)]

    def step(self, problem, actions):
        if len(actions) == 1:
            self.wait_for_newer_weights()
            return Feedback(reward=float(actions[0].startswith("a")), observation="!")
        return Feedback(reward=0.0, done=True)


class EchoAcrossASwap(_WaitsBetweenTurns):
    """The quickstart's `echo` task (`37c=` answers `c`, EchoEnv with `echo_args`, its `holdout`
    included), then one more turn: after the answer a training episode waits for weights newer than the
    ones it began with, and the model samples one more token with them. Every training batch but the first
    is sampled by two weight versions; evaluations do not wait.

    The second turn earns nothing. With reward-to-go credit (train/advantages.py) its token gets the
    same advantage in every rollout of a group, so it adds no signal for a wrong letter; a second
    graded question would credit the first answer with the second's reward (measured: 0.67-0.80 at
    step 100 instead of the quickstart's 0.8 at 50-60)."""

    env_name = "echo_across_a_swap"
    max_episode_tokens = 8

    def __init__(self, weights_root: str, echo_args: dict, timeout_s: float = 120.0):
        super().__init__(weights_root, timeout_s)
        self.echo = EchoEnv(**echo_args)

    def problems(self, n, rng, mode):
        return self.echo.problems(n, rng, mode)

    def step(self, problem, actions):
        if len(actions) == 1:
            self.wait_for_newer_weights()
            return Feedback(reward=grade_answer(actions[0], problem.answer).reward, observation=";")
        return Feedback(reward=0.0, done=True)
