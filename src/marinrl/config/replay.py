"""The replay buffer's config (`replay:` in the job config): its sampling strategies and group filters as
registered choices (their names, fields and checks; the buffer's code in train/replay/ dispatches on them),
the staleness reductions, and the loss's filter for it."""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Optional

import draccus
import numpy as np

from marinrl.config.checks import require_at_least
from marinrl.types import RolloutGroup

RewardFn = Callable[[RolloutGroup], "np.ndarray | tuple[np.ndarray, np.ndarray]"]
"""Maps a group to the rewards its filters and advantages use, one per rollout, or to `(rewards,
trainable)` where `trainable[i] = False` keeps rollout i in its group's baseline but trains none of its
tokens (DAPO's overlong masking). Must be a pure function of the group: it runs again when a file is
re-read after a restart. `train/replay/ingest.overlong_reward_fn` builds one from a loss config."""

TokenVersionReduction = Literal["oldest", "newest", "mean"]
TOKEN_VERSION_REDUCTIONS: tuple[str, ...] = ("oldest", "newest", "mean")
"""How a group's weight step is read from its tokens' steps (`train/replay/staleness.group_weight_step`)."""


# ----------------------------------------------------------------------------- sampling strategies


@dataclasses.dataclass(frozen=True)
class SamplingConfig(draccus.ChoiceRegistry):
    """Which groups a step may use and which it takes. A registered choice (`type: off_policy`).

    A strategy has `max_staleness` (usable while `0 <= step - weight_step <= max_staleness`) and
    `max_uses` (times one group may be trained on); which `k` of an environment's usable groups a step
    takes is its chooser in `train/replay/sampling.CHOOSERS`, under the same registered name. Adding a
    strategy is a registered dataclass here and its chooser there (docs/replay.md, "Sampling strategies").
    """

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "off_policy"

    @property
    def max_staleness(self) -> int:
        raise NotImplementedError

    @property
    def max_uses(self) -> int:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return SamplingConfig.get_choice_name(type(self))

    def describe(self) -> str:
        return f"{self.name} (max_staleness={self.max_staleness}, max_uses={self.max_uses})"


@SamplingConfig.register_subclass("on_policy")
@dataclasses.dataclass(frozen=True)
class OnPolicyConfig(SamplingConfig):
    """Exact on-policy: only groups of the trainer's current weights, each trained on once, oldest first;
    the trainer waits for them."""

    @property
    def max_staleness(self) -> int:
        return 0

    @property
    def max_uses(self) -> int:
        return 1


@SamplingConfig.register_subclass("off_policy")
@dataclasses.dataclass(frozen=True)
class OffPolicyConfig(SamplingConfig):
    """Each group trained on once, up to `max_staleness` weight versions old; oldest first, so the
    groups closest to expiry are used before they expire."""

    staleness: int = 1
    """Largest `step - weight_step` a group may have; 1 overlaps generation of batch N with training on N-1."""

    def __post_init__(self):
        require_at_least(self, 0, "staleness", prefix="off_policy")

    @property
    def max_staleness(self) -> int:
        return self.staleness

    @property
    def max_uses(self) -> int:
        return 1


@SamplingConfig.register_subclass("replay")
@dataclasses.dataclass(frozen=True)
class ReplaySamplingConfig(SamplingConfig):
    """Each group trained on up to `uses` times while at most `staleness` versions old; groups are
    drawn without replacement with probability ∝ `recency_decay ** (step - weight_step)`."""

    staleness: int = 4
    """Largest `step - weight_step` a group may have."""
    uses: int = 2
    """How many steps may train on one group."""
    recency_decay: float = 0.5
    """Weight of a group one version older relative to a fresher one; 1 draws uniformly."""

    def __post_init__(self):
        require_at_least(self, 0, "staleness", prefix="replay")
        require_at_least(self, 1, "uses", prefix="replay")
        if not 0 < self.recency_decay <= 1:
            raise ValueError(f"replay.recency_decay must be in (0, 1], got {self.recency_decay}")

    @property
    def max_staleness(self) -> int:
        return self.staleness

    @property
    def max_uses(self) -> int:
        return self.uses


# ----------------------------------------------------------------------------- group filters


@dataclasses.dataclass(frozen=True)
class GroupFilterConfig(draccus.ChoiceRegistry):
    """One step of the ingestion filter chain (`filters: [{type: zero_variance}, ...]`).

    Its code is `train/replay/filters.FILTERS[name]`: it takes the groups of one ingested rollout file and
    returns those it keeps, possibly with fewer rollouts (trimmed). What it leaves out is counted under
    its registered name. Adding a filter is a registered dataclass here and its function there.
    """

    @property
    def name(self) -> str:
        return GroupFilterConfig.get_choice_name(type(self))


@GroupFilterConfig.register_subclass("zero_variance")
@dataclasses.dataclass(frozen=True)
class ZeroVarianceFilter(GroupFilterConfig):
    """Drops groups whose rewards are all equal (DAPO dynamic sampling): their advantages are all zero."""


def _check_filter_ratio(name: str, ratio: Optional[float]) -> None:
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"{name}.filter_ratio must be in (0, 1] or null, got {ratio}")


@GroupFilterConfig.register_subclass("reward_mean")
@dataclasses.dataclass(frozen=True)
class RewardMeanFilter(GroupFilterConfig):
    """Keeps groups whose mean reward lies in [low, high] (e.g. drop prompts that are always or never
    solved), then, with `filter_ratio`, only the top share of those by mean reward."""

    low: float = float("-inf")
    high: float = float("inf")
    filter_ratio: Optional[float] = None
    """Of a rollout file's groups within [low, high], keep this share (0, 1] with the highest mean
    reward, per policy (`train/replay/filters.top_ratio`); null keeps them all."""

    def __post_init__(self):
        if not self.low <= self.high:
            raise ValueError(f"reward_mean needs low <= high, got low={self.low}, high={self.high}")
        _check_filter_ratio("reward_mean", self.filter_ratio)


@GroupFilterConfig.register_subclass("reward_std_quantile")
@dataclasses.dataclass(frozen=True)
class RewardStdQuantileFilter(GroupFilterConfig):
    """Keeps groups whose reward std lies between the `low` and `high` quantiles of the stds of the
    groups in the same rollout file (e.g. `low: 0.5` keeps the more informative half), then, with
    `filter_ratio`, only the top share of those by std. Quantiles and shares are taken per file so a
    file always filters the same way, whenever and however often it is read."""

    low: float = 0.0
    high: float = 1.0
    filter_ratio: Optional[float] = None
    """Of a rollout file's groups within the quantile band, keep this share (0, 1] with the highest
    reward std (the most informative), per policy (`train/replay/filters.top_ratio`); null keeps them all."""

    def __post_init__(self):
        if not 0 <= self.low <= self.high <= 1:
            raise ValueError(f"reward_std_quantile needs 0 <= low <= high <= 1, got low={self.low}, high={self.high}")
        _check_filter_ratio("reward_std_quantile", self.filter_ratio)


@GroupFilterConfig.register_subclass("trim_outliers")
@dataclasses.dataclass(frozen=True)
class TrimOutliersFilter(GroupFilterConfig):
    """Removes rollouts whose `metric` is more than `max_z` standard deviations from their group's mean
    (z-scores over the whole group; with G samples no |z| can exceed (G-1)/sqrt(G)). A group left with
    fewer than `min_size` rollouts is dropped. Advantages are computed after trimming."""

    metric: str = "reward"
    """`reward` (after reward_fn) or `response_length`."""
    max_z: float = 3.0
    min_size: int = 2

    def __post_init__(self):
        if self.metric not in ("reward", "response_length"):
            raise ValueError(f"trim_outliers.metric must be 'reward' or 'response_length', got {self.metric!r}")
        if self.max_z <= 0:
            raise ValueError(f"trim_outliers.max_z must be > 0, got {self.max_z}")
        if self.min_size < 1:
            raise ValueError(f"trim_outliers.min_size must be >= 1, got {self.min_size}")


# ----------------------------------------------------------------------------- the buffer


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
        `loss.advantage` to `ReplayBuffer`) and its overlong shaping (`train/replay/ingest.overlong_reward_fn`)."""
        filters = list(self.filters)
        if loss.drop_zero_variance_groups and not any(isinstance(f, ZeroVarianceFilter) for f in filters):
            filters.insert(0, ZeroVarianceFilter())
        return dataclasses.replace(self, filters=filters)

