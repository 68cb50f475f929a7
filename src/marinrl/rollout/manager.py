"""RolloutManager: the computing half of the rollout side (docs/architecture.md).

It owns the inference server, one environment per lesson (built once, cached) and the curriculum's
handle. It is stateless with respect to the run: `weight_step` and `worker_id` are arguments, never
fields, so the same manager serves a RolloutWorker, an offline evaluation of a saved checkpoint, or
a test, with no weight transfer and no storage.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Literal, Mapping, Optional, Protocol

import numpy as np

from marinrl.envs.base import COUNTERS, Env, safe_sample
from marinrl.inference.context import SamplingParams
from marinrl.logs import ENV_ERRORS
from marinrl.types import RolloutBatch, RolloutMetadata

logger = logging.getLogger(__name__)

Mode = Literal["train", "eval"]
EvalType = Literal["eval", "micro_eval"]


@dataclasses.dataclass(frozen=True)
class LessonRuntime:
    """What the manager needs to run a lesson: how to build its environment, and how to sample it."""

    make_env: Callable[[], Env]
    sampling: SamplingParams
    eval_sampling: Optional[SamplingParams] = None
    """Sampling for evaluations; default: greedy with the training token budget."""
    env_name: str = ""
    """The environment as configured (its `EnvConfig.name`), for error messages."""

    @property
    def eval_params(self) -> SamplingParams:
        """What evaluations sample with: `eval_sampling`, or greedy with the training settings."""
        return self.eval_sampling or dataclasses.replace(self.sampling, temperature=0.0)


class CurriculumStats(Protocol):
    def update_from_training(self, lesson_id: str, rewards: list[float], step: int) -> None: ...

    def update_from_eval(self, lesson_id: str, rewards: list[float], step: int) -> None: ...


class RolloutManager:
    """Environments plus the policy server; every method is a pure function of its arguments and the
    weights currently loaded."""

    def __init__(self, server, lessons: Mapping[str, LessonRuntime], curriculum: CurriculumStats | None = None):
        if not lessons:
            raise ValueError("RolloutManager needs at least one lesson")
        self.server = server
        self.lessons = dict(lessons)
        self.curriculum = curriculum
        self._envs: dict[str, Env] = {}

    @property
    def model(self):
        return self.server.model

    # ------------------------------------------------------------------ sampling

    def env(self, lesson_id: str) -> Env:
        """The lesson's environment, built on first use and cached (KeyError: no such lesson)."""
        if lesson_id not in self.lessons:
            raise KeyError(f"unknown lesson {lesson_id!r}; known: {sorted(self.lessons)}")
        env = self._envs.get(lesson_id)
        if env is None:
            env = self._envs[lesson_id] = self.lessons[lesson_id].make_env()
        return env

    def describe_env(self, lesson_id: str) -> str:
        """How errors name a lesson's environment: its class (once built) and its configured name."""
        runtime = self.lessons[lesson_id]
        env = self._envs.get(lesson_id)
        cls = type(env).__name__ if env is not None else None
        if cls and runtime.env_name and runtime.env_name != cls:
            return f"{cls} (env {runtime.env_name!r})"
        return cls or (f"env {runtime.env_name!r}" if runtime.env_name else "its environment")

    def _run_env(self, lesson_id: str, n_examples: int, n_generations: int, sampling: SamplingParams,
                 rng: np.random.Generator, mode: str, weight_step: int, worker_id: str):
        """One env call through `safe_sample`: an env that fails to construct or raises, and malformed
        groups, are counted (`<lesson>/env_failures`, `<lesson>/malformed_groups`), never raised."""
        try:
            env = self.env(lesson_id)
        except Exception as e:  # not cached: the next call tries again
            ENV_ERRORS.report(logger, f"building {self.describe_env(lesson_id)} of lesson {lesson_id!r} failed", e)
            return [], {f"{lesson_id}/{k}": float(k == "env_failures") for k in COUNTERS}
        return safe_sample(env, self.server, lesson_id=lesson_id, n_examples=n_examples,
                           n_generations=n_generations, sampling=sampling, rng=rng, mode=mode,
                           metadata=RolloutMetadata(worker_id, weight_step))

    def sample_batch(self, lesson_id: str, n_examples: int, n_generations: int, mode: Mode,
                     rng: np.random.Generator, weight_step: int, worker_id: str
                     ) -> tuple[Optional[RolloutBatch], dict[str, float]]:
        """Training rollouts of one lesson, stamped with `weight_step` and `worker_id`; None if the
        environment produced nothing usable (the reason is in the metrics)."""
        sampling = self.lessons[lesson_id].sampling if lesson_id in self.lessons else None
        if sampling is None:
            raise KeyError(f"unknown lesson {lesson_id!r}; known: {sorted(self.lessons)}")
        groups, metrics = self._run_env(lesson_id, n_examples, n_generations, sampling, rng, mode,
                                        weight_step, worker_id)
        if not groups:
            return None, metrics
        return RolloutBatch(tuple(groups), RolloutMetadata(worker_id, weight_step)), metrics

    def evaluate_lesson(self, lesson_id: str, n_examples: int, eval_type: EvalType, rng: np.random.Generator,
                        step: int, weight_step: int, worker_id: str
                        ) -> tuple[dict[str, float], Optional[RolloutBatch]]:
        """One greedy sample per prompt by default. Only full evals (`eval`) update the curriculum."""
        lesson = self.lessons.get(lesson_id)
        if lesson is None:
            raise KeyError(f"unknown lesson {lesson_id!r}; known: {sorted(self.lessons)}")
        sampling = lesson.eval_params
        groups, metrics = self._run_env(lesson_id, n_examples, 1, sampling, rng, "eval", weight_step, worker_id)
        rewards = [r.episode_reward for g in groups for r in g.rollouts]
        stats = {k.split("/", 1)[1]: v for k, v in metrics.items() if isinstance(v, float)}
        stats.update(reward_mean=float(np.mean(rewards)) if rewards else float("nan"), n=float(len(rewards)))
        if rewards:
            lengths = [r.response_tokens.size for g in groups for r in g.rollouts]
            stats["response_length_mean"] = float(np.mean(lengths))
            stats["finish_stop_frac"] = float(np.mean([r.finish_reason == "stop" for g in groups for r in g.rollouts]))
            by_policy: dict[str, list[float]] = {}
            for g in groups:
                for r in g.rollouts:
                    by_policy.setdefault(r.policy_name, []).append(r.episode_reward)
            if len(by_policy) > 1:  # several policies play this lesson: each one's reward
                stats.update({f"policy/{p}/reward_mean": float(np.mean(v)) for p, v in sorted(by_policy.items())})
        if eval_type == "eval" and rewards and self.curriculum is not None:
            self.curriculum.update_from_eval(lesson_id, rewards, step)
        batch = RolloutBatch(tuple(groups), RolloutMetadata(worker_id, weight_step)) if groups else None
        return stats, batch

    def evaluate_curriculum(self, n_examples: int, eval_type: EvalType, rng: np.random.Generator, step: int,
                            weight_step: int, worker_id: str
                            ) -> dict[str, tuple[dict[str, float], Optional[RolloutBatch]]]:
        return {lesson_id: self.evaluate_lesson(lesson_id, n_examples, eval_type, rng, step, weight_step, worker_id)
                for lesson_id in self.lessons}

    def update_training_stats(self, lesson_id: str, batch: RolloutBatch, step: int) -> None:
        if self.curriculum is not None:
            self.curriculum.update_from_training(lesson_id, [r.episode_reward for r in batch.rollouts], step)

    def update_model(self, model, weight_step: int = 0, model_name: str | None = None) -> None:
        """Serve new weights (no recompile). `weight_step` only labels the server's own reporting.
        `model_name`: which policy model's server, when the server is a `PolicyRouter`."""
        if model_name is None:
            self.server.reload(model, weight_step)
        else:
            self.server.reload(model, weight_step, model_name)

    def shutdown(self) -> None:
        flush = getattr(self.curriculum, "flush", None)  # statistics updates still in flight (CurriculumClient)
        if flush is not None:
            try:
                flush()
            except Exception as e:  # noqa: BLE001 - the curriculum's own errors are not the server's
                logger.warning("curriculum updates still in flight failed: %s", e)
        self.server.shutdown()

