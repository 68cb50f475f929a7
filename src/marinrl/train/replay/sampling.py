"""Sampling strategies' choosers: which `k` of an environment's usable groups a step takes.

The strategies are registered choices of the config layer (`config/replay.SamplingConfig`: `on_policy`,
`off_policy`, `replay`, with their staleness and reuse); `CHOOSERS` holds each one's code under the same
name (docs/replay.md, "Sampling strategies").
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from marinrl.config.replay import ReplaySamplingConfig, SamplingConfig
from marinrl.train.replay.groups import BufferedGroup

Chooser = Callable[[SamplingConfig, Sequence[BufferedGroup], int, int, np.random.Generator], list[BufferedGroup]]
"""(strategy, the usable candidates of one environment (at least `k`), k, step, rng) -> the `k` it takes."""


def oldest_first(candidates: Sequence[BufferedGroup]) -> list[BufferedGroup]:
    return sorted(candidates, key=lambda g: (g.weight_step, g.seq))


def take_oldest(strategy: SamplingConfig, candidates: Sequence[BufferedGroup], k: int, step: int,
                rng: np.random.Generator) -> list[BufferedGroup]:
    """The `k` oldest (`on_policy`, `off_policy`): the groups closest to expiry are used before they expire."""
    return oldest_first(candidates)[:k]


def draw_by_recency(strategy: ReplaySamplingConfig, candidates: Sequence[BufferedGroup], k: int, step: int,
                    rng: np.random.Generator) -> list[BufferedGroup]:
    """`replay`: `k` drawn without replacement with probability ∝ `recency_decay ** (step - weight_step)`."""
    ordered = oldest_first(candidates)
    weights = np.array([strategy.recency_decay ** (step - g.weight_step) for g in ordered], dtype=np.float64)
    # Weighted sampling without replacement: the k largest u^(1/w) (Efraimidis & Spirakis).
    keys = rng.random(len(ordered)) ** (1.0 / weights)
    picked = np.argsort(-keys, kind="stable")[:k]
    return [ordered[i] for i in sorted(picked)]


CHOOSERS: Mapping[str, Chooser] = {"on_policy": take_oldest, "off_policy": take_oldest, "replay": draw_by_recency}
"""A registered strategy's name -> its chooser (tests/test_replay.py holds every registered name here)."""


def choose(strategy: SamplingConfig, candidates: Sequence[BufferedGroup], k: int, step: int,
           rng: np.random.Generator) -> list[BufferedGroup]:
    """The `k` of `candidates` (one environment's usable groups, at least `k`) that `strategy` takes at `step`."""
    return CHOOSERS[strategy.name](strategy, candidates, k, step, rng)
