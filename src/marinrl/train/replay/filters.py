"""Group filters' code: the ingestion chain that drops or trims groups before their advantages are computed.

The filters are registered choices of the config layer (`config/replay.GroupFilterConfig`:
`replay.filters: [{type: zero_variance}, ...]`); `FILTERS` holds each one's function under the same name,
applied in order to the groups of one rollout file (docs/replay.md, "Filters").
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from marinrl.config.replay import (
    GroupFilterConfig,
    RewardMeanFilter,
    RewardStdQuantileFilter,
    TrimOutliersFilter,
    ZeroVarianceFilter,
)
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


def zero_variance(config: ZeroVarianceFilter, groups: list[ScoredGroup]) -> list[ScoredGroup]:
    return [g for g in groups if np.ptp(g.rewards) > 0]


def reward_mean(config: RewardMeanFilter, groups: list[ScoredGroup]) -> list[ScoredGroup]:
    kept = [g for g in groups if config.low <= g.rewards.mean() <= config.high]
    return top_ratio(kept, [g.rewards.mean() for g in kept], config.filter_ratio)


def reward_std_quantile(config: RewardStdQuantileFilter, groups: list[ScoredGroup]) -> list[ScoredGroup]:
    if not groups:
        return groups
    stds = np.array([g.rewards.std() for g in groups])
    lo, hi = np.quantile(stds, [config.low, config.high])
    band = [(g, s) for g, s in zip(groups, stds) if lo <= s <= hi]
    return top_ratio([g for g, _ in band], [s for _, s in band], config.filter_ratio)


def trim_outliers(config: TrimOutliersFilter, groups: list[ScoredGroup]) -> list[ScoredGroup]:
    kept = []
    for g in groups:
        if config.metric == "reward":
            x = g.rewards
        else:
            x = np.array([r.response_tokens.size for r in g.group.rollouts], dtype=np.float64)
        std = x.std()
        keep = np.ones(x.size, dtype=bool) if std == 0 else np.abs(x - x.mean()) <= config.max_z * std
        if keep.sum() < config.min_size:
            continue
        kept.append(g if keep.all() else g.subset(keep))
    return kept


FILTERS: Mapping[str, Callable[[GroupFilterConfig, list[ScoredGroup]], list[ScoredGroup]]] = {
    "zero_variance": zero_variance, "reward_mean": reward_mean, "reward_std_quantile": reward_std_quantile,
    "trim_outliers": trim_outliers}
"""A registered filter's name -> its function (what each does: its config's docstring; tests/test_replay.py
holds every registered name here)."""


def apply_filter(config: GroupFilterConfig, groups: list[ScoredGroup]) -> list[ScoredGroup]:
    """The groups of one rollout file that the filter `config` keeps, possibly trimmed."""
    return FILTERS[config.name](config, groups)
