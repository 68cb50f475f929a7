"""What a rollout file's groups go through before they enter the replay buffer (`marinrl/train/replay/buffer.py`):
the policy check, validity (one environment, non-empty prompts, rows that fit), the environment
weights, rewards (optionally reshaped) and the configured group filters. Pure functions of the batch
and the configuration, so a file re-read after a restart is decided exactly as the first time."""

from __future__ import annotations

import collections
import logging
from typing import Mapping, Sequence

import numpy as np

from marinrl.config.loss import LossConfig
from marinrl.config.replay import GroupFilterConfig, RewardFn
from marinrl.train.advantages import overlong_shaping
from marinrl.train.replay.filters import ScoredGroup, apply_filter
from marinrl.types import RolloutBatch, RolloutGroup

logger = logging.getLogger(__name__)


class UnknownPolicyError(ValueError):
    """A rollout tagged with a policy this trainer does not train, met at ingestion (`marinrl/config/policies.py`)."""


def prepare_batch(batch: RolloutBatch, *, filters: Sequence[GroupFilterConfig], env_weights: Mapping[str, float] | None,
                  max_tokens: int | None, reward_fn: RewardFn | None, policies: frozenset[str] | None):
    """Rewards, validity and filters of one batch: (kept groups, group drops, rollout drops) by reason.
    A group of a policy not in `policies` (None: any) raises `UnknownPolicyError`."""
    dropped: collections.Counter[str] = collections.Counter()
    dropped_rollouts: collections.Counter[str] = collections.Counter()

    def drop(g: RolloutGroup, reason: str):
        dropped[reason] += 1
        dropped_rollouts[reason] += len(g)

    scored = []
    for g in batch.groups:
        check_policy(g, policies)
        envs = {r.env_name for r in g.rollouts}
        if len(envs) != 1:
            logger.error("group %r mixes environments %s; dropped", g.group_id, sorted(envs))
            drop(g, "invalid")
            continue
        if env_weights is not None and next(iter(envs)) not in env_weights:
            drop(g, "unweighted_env")
            continue
        if any(r.prompt_tokens.size == 0 for r in g.rollouts):
            logger.error("group %r has a rollout with an empty prompt; dropped", g.group_id)
            drop(g, "invalid")
            continue
        if max_tokens is not None and max(r.num_tokens for r in g.rollouts) > max_tokens:
            drop(g, "too_long")
            continue
        scored.append(score_group(g, reward_fn))
    for f in filters:
        before = {s.group.group_id: len(s.group) for s in scored}
        scored = apply_filter(f, scored)
        after = {s.group.group_id: len(s.group) for s in scored}
        for gid, n in before.items():
            if gid not in after:
                dropped[f.name] += 1
                dropped_rollouts[f.name] += n
            elif after[gid] < n:
                dropped_rollouts[f.name] += n - after[gid]
    return scored, dropped, dropped_rollouts

def check_policy(g: RolloutGroup, policies: frozenset[str] | None) -> None:
    """A policy this trainer does not train is a config error, never trained into this model."""
    if policies is None:
        return
    unknown = sorted({r.policy_name for r in g.rollouts} - policies)
    if unknown:
        r = g.rollouts[0]
        raise UnknownPolicyError(
            f"rollouts of lesson {r.lesson_id!r} (environment {r.env_name!r}, agent {r.agent_name!r}) are tagged "
            f"with policy {unknown[0]!r}, which this trainer does not train (it trains "
            f"{', '.join(map(repr, sorted(policies)))}); define it under `policies:` in the job config")

def score_group(g: RolloutGroup, reward_fn: RewardFn | None) -> ScoredGroup:
    """The group's rewards (reshaped by `reward_fn`, if any) and which rollouts are trainable."""
    out = g.rewards if reward_fn is None else reward_fn(g)
    rewards, trainable = out if isinstance(out, tuple) else (out, np.ones(len(g), dtype=bool))
    rewards, trainable = np.asarray(rewards, dtype=np.float64), np.asarray(trainable)
    if rewards.shape != (len(g),) or not np.all(np.isfinite(rewards)):
        raise ValueError(f"reward_fn returned rewards {rewards!r} for group {g.group_id!r} of {len(g)} rollouts; "
                         f"expected {len(g)} finite numbers")
    if trainable.shape != (len(g),) or trainable.dtype != np.bool_:
        raise ValueError(f"reward_fn returned trainable {trainable!r} for group {g.group_id!r}; expected {len(g)} "
                         f"booleans")
    return ScoredGroup(g, rewards, trainable)


def overlong_reward_fn(loss: LossConfig) -> RewardFn | None:
    """The `reward_fn` of a loss config's overlong shaping (`advantages.overlong_shaping`), None for `none`.

    A response is truncated when its `finish_reason` is `length`; its length is its number of response
    tokens (environment tokens of multi-turn episodes included: they count against the same budget).
    """
    if loss.overlong == "none":
        return None

    def shape(group: RolloutGroup):
        return overlong_shaping(
            group.rewards,
            np.array([r.response_tokens.size for r in group.rollouts], dtype=np.int64),
            np.array([r.finish_reason == "length" for r in group.rollouts]),
            mode=loss.overlong,
            max_response_tokens=loss.max_response_tokens,
            cache_tokens=loss.overlong_cache_tokens,
            penalty=loss.overlong_penalty,
        )

    return shape
