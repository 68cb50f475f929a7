"""The replay buffer's config (`replay:` in the job config) and the loss's reward shaping for it."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from marinrl.config.checks import require_at_least
from marinrl.train.advantages import overlong_shaping
from marinrl.train.replay.filters import GroupFilterConfig, ZeroVarianceFilter
from marinrl.train.replay.sampling import OffPolicyConfig, SamplingConfig
from marinrl.train.replay.staleness import TOKEN_VERSION_REDUCTIONS, TokenVersionReduction
from marinrl.types import RolloutGroup

RewardFn = Callable[[RolloutGroup], "np.ndarray | tuple[np.ndarray, np.ndarray]"]
"""Maps a group to the rewards its filters and advantages use, one per rollout, or to `(rewards,
trainable)` where `trainable[i] = False` keeps rollout i in its group's baseline but trains none of its
tokens (DAPO's overlong masking). Must be a pure function of the group: it runs again when a file is
re-read after a restart. `overlong_reward_fn` builds one from a loss config."""


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """The trainer's replay buffer."""

    sampling: SamplingConfig = dataclasses.field(default_factory=OffPolicyConfig)
    """Staleness window, reuse and which usable groups a step takes: on_policy, off_policy, replay."""
    env_weights: dict[str, float] | None = None
    """Share of each step's groups per environment. Set: each batch is mixed by these weights
    (cumulatively exact across steps) and groups of other environments are dropped. None: groups are
    taken regardless of environment."""
    filters: list[GroupFilterConfig] = dataclasses.field(default_factory=list)
    """Group filters applied in order at ingestion."""
    capacity_per_env: int = 4096
    """Groups kept per environment; past it the oldest are evicted."""
    max_age_s: float | None = None
    """Groups whose rollouts were created longer ago than this (wall clock) are dropped."""
    timeout_s: float = 600.0
    """How long `sample()` waits for a complete batch by default."""
    poll_interval_s: float = 1.0
    """How often the reader is listed when it had nothing new and the trainer is not waiting (while it
    waits: right away, then from 10 ms doubling up to 100 ms)."""
    max_files_per_poll: int = 64
    """Files read per poll, so the buffer stays responsive while a backlog is read."""
    seed: int = 0
    """Seeds the random draws of strategies (with the step, so a resumed run draws the same)."""
    token_version_reduction: TokenVersionReduction = "oldest"
    """The weight step a group counts as, for staleness and the strategies, when in-flight weight updates
    gave its tokens several (`Rollout.weight_steps`): `oldest` token, `newest` token, or the token-weighted
    `mean` rounded down. Files are still listed by the step their rollouts began with, so with `newest`
    or `mean` a rollout that began before the window is not read."""

    def __post_init__(self):
        if self.token_version_reduction not in TOKEN_VERSION_REDUCTIONS:
            raise ValueError(f"ReplayConfig.token_version_reduction must be one of {TOKEN_VERSION_REDUCTIONS}, "
                             f"got {self.token_version_reduction!r}")
        if self.env_weights is not None:
            if not self.env_weights:
                raise ValueError("ReplayConfig.env_weights is empty; use None to take groups regardless of env")
            bad = {e: w for e, w in self.env_weights.items() if not (np.isfinite(w) and w >= 0)}
            if bad or sum(self.env_weights.values()) <= 0:
                raise ValueError(f"ReplayConfig.env_weights must be finite, >= 0 and not all 0, got {self.env_weights}")
        require_at_least(self, 1, "capacity_per_env", "max_files_per_poll")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"ReplayConfig.max_age_s must be > 0 or None, got {self.max_age_s}")
        require_at_least(self, 0, "timeout_s", "poll_interval_s")

    def for_loss(self, loss) -> ReplayConfig:
        """This config with a `zero_variance` filter first when the loss (`losses.LossConfig`) sets
        `drop_zero_variance_groups`. The loss also decides the buffer's `advantage` (pass
        `loss.advantage` to `ReplayBuffer`) and its overlong shaping (`overlong_reward_fn(loss)`)."""
        filters = list(self.filters)
        if loss.drop_zero_variance_groups and not any(isinstance(f, ZeroVarianceFilter) for f in filters):
            filters.insert(0, ZeroVarianceFilter())
        return dataclasses.replace(self, filters=filters)


def overlong_reward_fn(loss) -> RewardFn | None:
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
