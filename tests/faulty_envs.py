"""Environments that fail the way user environments do, importable by dotted path from Ray actors
(`EnvConfig("faulty_envs:RaisesInSample")`): tests/ is on the driver's sys.path, which Ray gives its
workers."""

from __future__ import annotations

from marinrl.envs.base import Grade, Problem, SingleTurnEnv

ERROR_TEXT = "grader crashed: the answer key is missing"


class RaisesInSample:
    """Fails every call, as a grader with a missing dependency does."""

    def sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        raise RuntimeError(ERROR_TEXT)


class StartsWithA(SingleTurnEnv):
    """Reward 1 when the response starts with 'a'; problem i is `say a <i>`."""

    env_name = "starts_with_a"

    def problems(self, n, rng, mode):
        return [Problem(prompt=f"say a {i}", answer="a", example_id=str(i)) for i in range(n)]

    def grade(self, problem, response):
        return Grade(float(response.startswith("a")))


class NaNGrader(StartsWithA):
    """A grader that returns NaN for every problem whose index is a multiple of `nan_every`
    (1: every problem, so no group is usable)."""

    env_name = "nan_grader"

    def __init__(self, nan_every: int = 1):
        self.nan_every = nan_every

    def grade(self, problem, response):
        if int(problem.example_id) % self.nan_every == 0:
            return Grade(float("nan"))
        return super().grade(problem, response)


class FailsTwiceInThree(StartsWithA):
    """Raises on two calls out of every three: never `3` failures in a row."""

    env_name = "fails_twice_in_three"

    def __init__(self):
        self.calls = 0

    def sample(self, *args):
        self.calls += 1
        if self.calls % 3:
            raise RuntimeError(f"flaky call {self.calls}")
        return super().sample(*args)
