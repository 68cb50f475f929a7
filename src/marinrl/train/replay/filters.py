"""Group filters: the ingestion chain that drops or trims groups before their advantages are computed.

A registered choice (`replay.filters: [{type: zero_variance}, ...]`), applied in order to the groups
of one rollout file (docs/replay.md, "Filters").
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional, Sequence

import draccus
import numpy as np

from marinrl.types import RolloutGroup


@dataclasses.dataclass(frozen=True)
class ScoredGroup:
    """A group with the rewards filters and advantages use (after `reward_fn`), and which rollouts train."""

    group: RolloutGroup
    rewards: np.ndarray
    trainable: np.ndarray

    def subset(self, keep: np.ndarray) -> ScoredGroup:
        idx = np.flatnonzero(keep)
        return ScoredGroup(RolloutGroup(tuple(self.group.rollouts[i] for i in idx)), self.rewards[idx],
                           self.trainable[idx])


@dataclasses.dataclass(frozen=True)
class GroupFilterConfig(draccus.ChoiceRegistry):
    """One step of the ingestion filter chain (`filters: [{type: zero_variance}, ...]`).

    `apply` takes the groups of one ingested rollout file and returns those it keeps, possibly with
    fewer rollouts (trimmed). What it leaves out is counted under its registered name.
    """

    def apply(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return GroupFilterConfig.get_choice_name(type(self))


@GroupFilterConfig.register_subclass("zero_variance")
@dataclasses.dataclass(frozen=True)
class ZeroVarianceFilter(GroupFilterConfig):
    """Drops groups whose rewards are all equal (DAPO dynamic sampling): their advantages are all zero."""

    def apply(self, groups):
        return [g for g in groups if np.ptp(g.rewards) > 0]


def _check_filter_ratio(name: str, ratio: Optional[float]) -> None:
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"{name}.filter_ratio must be in (0, 1] or null, got {ratio}")


def top_ratio(groups: list[ScoredGroup], stats: Sequence[float], ratio: Optional[float]) -> list[ScoredGroup]:
    """The `ratio` of `groups` with the highest `stats`, ranked per policy (a policy's groups compete
    only with each other): ceil(ratio × n) of each policy's n, so at least one. Ties go to the smaller
    group id, so the choice depends on the file's groups and not on their order, which is kept."""
    if ratio is None or not groups:
        return groups
    by_policy: dict[str, list[int]] = collections.defaultdict(list)
    for i, g in enumerate(groups):
        by_policy[g.group.rollouts[0].policy_name].append(i)
    keep: set[int] = set()
    for members in by_policy.values():
        k = math.ceil(round(ratio * len(members), 9))  # round: 0.7 * 10 is 7.000000000000001
        keep.update(sorted(members, key=lambda i: (-stats[i], groups[i].group.group_id))[:k])
    return [g for i, g in enumerate(groups) if i in keep]


@GroupFilterConfig.register_subclass("reward_mean")
@dataclasses.dataclass(frozen=True)
class RewardMeanFilter(GroupFilterConfig):
    """Keeps groups whose mean reward lies in [low, high] (e.g. drop prompts that are always or never
    solved), then, with `filter_ratio`, only the top share of those by mean reward."""

    low: float = float("-inf")
    high: float = float("inf")
    filter_ratio: Optional[float] = None
    """Of a rollout file's groups within [low, high], keep this share (0, 1] with the highest mean
    reward, per policy (`top_ratio`); null keeps them all."""

    def __post_init__(self):
        if not self.low <= self.high:
            raise ValueError(f"reward_mean needs low <= high, got low={self.low}, high={self.high}")
        _check_filter_ratio("reward_mean", self.filter_ratio)

    def apply(self, groups):
        kept = [g for g in groups if self.low <= g.rewards.mean() <= self.high]
        return top_ratio(kept, [g.rewards.mean() for g in kept], self.filter_ratio)


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
    reward std (the most informative), per policy (`top_ratio`); null keeps them all."""

    def __post_init__(self):
        if not 0 <= self.low <= self.high <= 1:
            raise ValueError(f"reward_std_quantile needs 0 <= low <= high <= 1, got low={self.low}, high={self.high}")
        _check_filter_ratio("reward_std_quantile", self.filter_ratio)

    def apply(self, groups):
        if not groups:
            return groups
        stds = np.array([g.rewards.std() for g in groups])
        lo, hi = np.quantile(stds, [self.low, self.high])
        band = [(g, s) for g, s in zip(groups, stds) if lo <= s <= hi]
        return top_ratio([g for g, _ in band], [s for _, s in band], self.filter_ratio)


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

    def apply(self, groups):
        kept = []
        for g in groups:
            if self.metric == "reward":
                x = g.rewards
            else:
                x = np.array([r.response_tokens.size for r in g.group.rollouts], dtype=np.float64)
            std = x.std()
            keep = np.ones(x.size, dtype=bool) if std == 0 else np.abs(x - x.mean()) <= self.max_z * std
            if keep.sum() < self.min_size:
                continue
            kept.append(g if keep.all() else g.subset(keep))
        return kept
