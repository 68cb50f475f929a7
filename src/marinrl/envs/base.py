"""The environment protocol, its registry (`registry.py`), the helpers environments build rollouts with, and
`safe_sample`, which runs an environment so that nothing it does can take its caller down.

An environment turns an inference context plus sampling settings into rollout groups and metrics
(docs/architecture.md, "The contracts"):

    groups, metrics = env.sample(ctx, n_examples, n_generations, sampling, rng, mode)

It describes *what happened* (prompts, responses, rewards, masks, agent and policy names). It does
not know *who ran it, with which weights, for which lesson*: its rollouts carry the placeholders
`UNSTAMPED` (metadata) and `UNSTAMPED_LESSON`, and `safe_sample` replaces both with the caller's
`RolloutMetadata` and lesson id. Stamping rebuilds every rollout, which re-runs its validation, so a
rollout corrupted after it was built (a NaN written into a reward array) is caught there too.

To add an environment: write a class with `sample(...)` (or subclass `SingleTurnEnv` for a prompt-and-grade
task) and decorate it with `@register_env("name")` (the registry: `registry.py`, its names re-exported here); a
lesson then names it (`env: {name: ..., args: {...}}`). A class outside this package needs no registration: a
lesson names it by its dotted path. A built-in one's module goes in `BUILTIN_ENVS`, so it is imported when a
config names it. docs/environments.md has the recipe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from marinrl.config.env import EnvConfig
from marinrl.envs.registry import (
    BUILTIN_ENVS,
    make_env,
    needs_endpoint,
    optional_package,
    register_env,
    registered_envs,
    with_endpoint_if_needed,
)
from marinrl.inference.context import Generation, InferenceContext, SamplingParams, chat_prompt_tokens
from marinrl.logs import ENV_ERRORS
from marinrl.types import DEFAULT_AGENT, DEFAULT_POLICY, Rollout, RolloutGroup, RolloutMetadata

__all__ = [
    "BUILTIN_ENVS", "COUNTERS", "MODES", "UNSTAMPED", "UNSTAMPED_LESSON", "Env", "EnvConfig", "Grade", "Mode",
    "Problem", "SingleTurnEnv", "check_sample_args", "completion_text", "encode_prompt", "make_env", "make_rollout",
    "needs_endpoint", "new_group_id", "optional_package", "register_env", "registered_envs", "safe_sample",
    "with_endpoint_if_needed",
]

logger = logging.getLogger(__name__)

Mode = Literal["train", "eval"]
MODES: tuple[str, ...] = ("train", "eval")

UNSTAMPED = RolloutMetadata(worker_id="unstamped", weight_step=0, created_at=0.0)
"""Metadata an environment puts on its rollouts; `safe_sample` replaces it with the caller's."""
COUNTERS: tuple[str, ...] = ("env_failures", "malformed_groups", "dropped_metrics")
"""`safe_sample` metrics that count failures in one call (a caller sums them into running totals)."""
UNSTAMPED_LESSON = "unstamped"
"""Lesson id an environment puts on its rollouts; `safe_sample` replaces it with the caller's."""


@runtime_checkable
class Env(Protocol):
    """What the RolloutManager calls. `mode` is "train" or "eval" (an environment may draw eval
    problems from a held-out set); `rng` drives every random choice, including the sampler's seed.

    Every returned group holds the rollouts of one prompt under one `group_id`, unique across all
    calls, all workers and all runs (use `new_group_id`): `n_generations` of them for a single-turn
    task, fewer where episodes ended early or failed (multi-turn and multi-agent groups are made per
    (problem, turn, agent)), never more."""

    def sample(
        self,
        ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        sampling: SamplingParams,
        rng: np.random.Generator,
        mode: Mode,
    ) -> tuple[list[RolloutGroup], dict[str, float]]: ...


# ------------------------------------------------------------------------ building rollouts


def new_group_id(env_name: str, example_id: str = "") -> str:
    """A globally unique group id (a random UUID), readable: `<env>:<example>:<uuid hex>`."""
    return f"{env_name}:{example_id}:{uuid.uuid4().hex}" if example_id else f"{env_name}:{uuid.uuid4().hex}"


def make_rollout(
    prompt_tokens: Sequence[int],
    generation: Generation,
    *,
    reward: float,
    temperature: float,
    env_name: str,
    group_id: str,
    loss_mask: Optional[np.ndarray] = None,
    token_rewards: Optional[np.ndarray] = None,
    agent_name: str = DEFAULT_AGENT,
    policy_name: str = DEFAULT_POLICY,
) -> Rollout:
    """A rollout of one generation, unstamped (see module docstring).

    By default every response token is trained (`loss_mask` 1) and the episode reward sits on the last
    token. Multi-turn environments pass their own `loss_mask` (0 on environment tokens) and
    `token_rewards` (each turn's reward on that turn's last token); `generation.logprobs` must then
    cover the whole response, with any value where the mask is 0."""
    tokens = np.asarray(generation.tokens)
    n = tokens.size
    if token_rewards is None:
        token_rewards = np.zeros(n, dtype=np.float32)
        if n:
            token_rewards[-1] = reward
    return Rollout(
        prompt_tokens=np.asarray(prompt_tokens),
        response_tokens=tokens,
        response_logprobs=generation.logprobs,
        temperature=temperature,
        loss_mask=np.ones(n, dtype=bool) if loss_mask is None else loss_mask,
        token_rewards=token_rewards,
        episode_reward=reward,
        finish_reason=generation.finish_reason,
        env_name=env_name,
        lesson_id=UNSTAMPED_LESSON,
        group_id=group_id,
        metadata=UNSTAMPED,
        agent_name=agent_name,
        policy_name=policy_name,
        weight_steps=generation.weight_steps,
    )


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Prompt tokens of `text`: one user turn through the chat template (`chat`), or the raw text
    after the tokenizer's BOS token (if it has one)."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; use chat: false")
        return chat_prompt_tokens(tokenizer, [{"role": "user", "content": text}])
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    bos = tokenizer.bos_token_id
    return ids if bos is None or (ids and ids[0] == bos) else [int(bos)] + ids


def completion_text(tokenizer, generation: Generation, sampling: SamplingParams) -> str:
    """The text a grader sees: the response without the EOS or stop sequence that ended it.
    Other special tokens stay in the text (a response that contains one is not a clean answer)."""
    tokens = [int(t) for t in np.asarray(generation.tokens).tolist()]
    if generation.finish_reason == "stop" and tokens:
        if tokenizer.eos_token_id is not None and tokens[-1] == tokenizer.eos_token_id:
            tokens = tokens[:-1]
        else:
            for stop in sampling.stop_sequences:
                if len(stop) <= len(tokens) and tuple(tokens[-len(stop):]) == tuple(stop):
                    tokens = tokens[: -len(stop)]
                    break
    return tokenizer.decode(tokens, skip_special_tokens=False)


# ------------------------------------------------------------------------ single-turn tasks


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a single-turn task and what grading needs to know about it."""

    prompt: str
    answer: str
    example_id: str = ""
    """Stable id of the problem (a dataset row, a generator's parameters): part of the group id."""


@dataclasses.dataclass(frozen=True)
class Grade:
    """A grader's verdict on one response: its reward and 0/1 indicators reported as metrics."""

    reward: float
    indicators: Mapping[str, float] = dataclasses.field(default_factory=dict)


def check_sample_args(n_examples: int, n_generations: int, mode: str) -> None:
    if n_examples < 1:
        raise ValueError(f"n_examples must be >= 1, got {n_examples}")
    if n_generations < 1:
        raise ValueError(f"n_generations must be >= 1, got {n_generations}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


class SingleTurnEnv:
    """Base for tasks with one prompt and one graded response: subclasses give `problems` and `grade`.

    `sample` encodes the prompts (raw text, or through the chat template when `chat`), generates all
    samples in one `ctx.generate` call, grades each response's text and returns one group per problem.
    Metrics: `reward_mean`, `reward_std`, `<indicator>_frac` and `<indicator>_count` for each grade
    indicator, `response_tokens_mean`, `truncated_frac` (budget ran out), `zero_variance_groups_frac`
    (groups whose rewards are all equal: no group-relative signal), `n_samples`, and, when some were,
    `malformed_groups` (groups dropped because `grade` gave a sample a NaN or infinite reward: the
    other groups are kept)."""

    env_name: str = "single_turn"
    chat: bool = False
    agent_name: str = DEFAULT_AGENT
    policy_name: str = DEFAULT_POLICY

    def problems(self, n: int, rng: np.random.Generator, mode: Mode) -> list[Problem]:
        raise NotImplementedError

    def grade(self, problem: Problem, response: str) -> Grade:
        raise NotImplementedError

    def encode(self, tokenizer, problem: Problem) -> list[int]:
        """Prompt tokens of `problem`: its text as one user turn (`chat`) or raw after BOS. Override to
        add a system message."""
        return encode_prompt(tokenizer, problem.prompt, chat=self.chat)

    def sample(
        self,
        ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        sampling: SamplingParams,
        rng: np.random.Generator,
        mode: Mode,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        check_sample_args(n_examples, n_generations, mode)
        problems = self.problems(n_examples, rng, mode)
        tokenizer = ctx.tokenizer
        prompts = [self.encode(tokenizer, p) for p in problems]
        seed = int(rng.integers(0, 2**31 - 1))
        generations = ctx.generate(prompts, n_generations, sampling, seed)
        if len(generations) != len(prompts):
            raise RuntimeError(f"ctx.generate returned {len(generations)} rows for {len(prompts)} prompts")
        groups: list[RolloutGroup] = []
        rewards: list[float] = []
        indicators: dict[str, list[float]] = {}
        lengths: list[int] = []
        truncated = 0
        zero_variance = 0
        dropped = 0
        for problem, prompt, samples in zip(problems, prompts, generations):
            if len(samples) != n_generations:
                raise RuntimeError(f"ctx.generate returned {len(samples)} samples, asked for {n_generations}")
            group_id = new_group_id(self.env_name, problem.example_id)
            grades = [self.grade(problem, completion_text(tokenizer, gen, sampling)) for gen in samples]
            bad = [g.reward for g in grades if not math.isfinite(g.reward)]
            if bad:  # one broken grade drops its group (counted), not the whole call
                dropped += 1
                ENV_ERRORS.report(logger, f"{type(self).__name__}.grade returned a non-finite reward ({bad[0]!r}); "
                                          "its group is dropped", level=logging.WARNING)
                continue
            rollouts = []
            for gen, grade in zip(samples, grades):
                rollouts.append(make_rollout(
                    prompt, gen, reward=grade.reward, temperature=sampling.temperature, env_name=self.env_name,
                    group_id=group_id, agent_name=self.agent_name, policy_name=self.policy_name))
                rewards.append(float(grade.reward))
                for k, v in grade.indicators.items():
                    indicators.setdefault(k, []).append(float(v))
                lengths.append(int(np.asarray(gen.tokens).size))
                truncated += gen.finish_reason == "length"
            group = RolloutGroup(tuple(rollouts))
            zero_variance += bool(np.all(group.rewards == group.rewards[0]))
            groups.append(group)
        if not groups:
            return [], {"malformed_groups": float(dropped)}
        metrics = {
            "reward_mean": float(np.mean(rewards)),
            "reward_std": float(np.std(rewards)),
            "response_tokens_mean": float(np.mean(lengths)),
            "truncated_frac": truncated / len(rewards),
            "zero_variance_groups_frac": zero_variance / len(groups),
            "n_samples": float(len(rewards)),
        }
        if dropped:
            metrics["malformed_groups"] = float(dropped)
        for k, values in indicators.items():
            metrics[f"{k}_frac"] = float(np.mean(values))
            metrics[f"{k}_count"] = float(np.sum(values))
        return groups, metrics


# ------------------------------------------------------------------------ running an env safely


def safe_sample(
    env: Env,
    ctx: InferenceContext,
    *,
    lesson_id: str,
    n_examples: int,
    n_generations: int,
    sampling: SamplingParams,
    rng: np.random.Generator,
    mode: Mode,
    metadata: RolloutMetadata,
) -> tuple[list[RolloutGroup], dict[str, float]]:
    """Run `env.sample` and stamp its rollouts with `metadata` and `lesson_id`; never raises for what
    the environment does.

    An environment that raises, or returns something other than (groups, metrics), yields no groups
    and `<lesson>/env_failures` 1. A group that is not a `RolloutGroup`, holds more than
    `n_generations` rollouts, repeats a group id, or holds a rollout that fails validation when
    stamped (a NaN reward, say) is dropped and counted in `<lesson>/malformed_groups`; the other
    groups are returned. Every failure is logged with the lesson id, each distinct one once with its
    traceback and its repeats as counts (`marinrl.logs.ENV_ERRORS`, whose `last()` is the text of the
    last one). Counters (`COUNTERS`) are this call's counts; callers keep running totals. Metric keys are
    `<lesson_id>/<name>`; environment metrics that are not finite numbers are dropped and counted in
    `<lesson>/dropped_metrics`. Arguments the caller got wrong (mode, sizes) still raise."""
    check_sample_args(n_examples, n_generations, mode)
    if not isinstance(metadata, RolloutMetadata):
        raise TypeError(f"metadata must be a RolloutMetadata, got {type(metadata).__name__}")
    p = f"{lesson_id}/"
    metrics: dict[str, float] = {p + "env_failures": 0.0, p + "malformed_groups": 0.0, p + "dropped_metrics": 0.0}
    started = time.perf_counter()
    try:
        result = env.sample(ctx, n_examples, n_generations, sampling, rng, mode)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"sample() must return (groups, metrics), got {type(result).__name__}")
        groups, env_metrics = result
        groups = list(groups)
        env_metrics = dict(env_metrics or {})
    except Exception as e:
        ENV_ERRORS.report(logger, f"environment {type(env).__name__} of lesson {lesson_id!r} failed", e)
        metrics[p + "env_failures"] = 1.0
        metrics[p + "sample_seconds"] = time.perf_counter() - started
        return [], metrics
    metrics[p + "sample_seconds"] = time.perf_counter() - started
    for k, v in env_metrics.items():
        if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(v):
            if k in COUNTERS:  # an environment's own count (e.g. groups it dropped) adds to ours
                metrics[p + str(k)] += float(v)
            else:
                metrics[p + str(k)] = float(v)
        else:
            metrics[p + "dropped_metrics"] += 1.0
            ENV_ERRORS.report(logger, f"lesson {lesson_id!r}: environment metric {k!r} = {v!r} is not a finite "
                                      "number; dropped", level=logging.WARNING)
    stamped: list[RolloutGroup] = []
    seen: set[str] = set()
    for group in groups:
        try:
            stamped.append(_stamp(group, n_generations, metadata, lesson_id, seen))
        except Exception as e:  # malformed in any way: drop this group, keep the others
            metrics[p + "malformed_groups"] += 1.0
            ENV_ERRORS.report(logger, f"lesson {lesson_id!r}: environment {type(env).__name__} returned a malformed "
                                      f"group (dropped)", e, level=logging.WARNING, traceback=False)
    metrics[p + "groups"] = float(len(stamped))
    return stamped, metrics


def _stamp(group: Any, n_generations: int, metadata: RolloutMetadata, lesson_id: str, seen: set[str]) -> RolloutGroup:
    if not isinstance(group, RolloutGroup):
        raise TypeError(f"expected a RolloutGroup, got {type(group).__name__}")
    if len(group) > n_generations:
        raise ValueError(f"group {group.group_id!r} holds {len(group)} rollouts, more than "
                         f"n_generations={n_generations}")
    if group.group_id in seen:
        raise ValueError(f"group_id {group.group_id!r} appears twice in one call")
    # dataclasses.replace re-runs Rollout validation: arrays mutated after construction are caught here.
    rollouts = tuple(dataclasses.replace(r, metadata=metadata, lesson_id=lesson_id) for r in group.rollouts)
    seen.add(group.group_id)
    return RolloutGroup(rollouts)
