"""Sampling strategies: which groups a trainer step may use (staleness, reuse) and which it takes.

A registered choice (`replay.sampling: {type: on_policy | off_policy | replay}`); adding a strategy is
one registered dataclass (docs/replay.md, "Sampling strategies").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import draccus
import numpy as np

from marinrl.config.checks import require_at_least

if TYPE_CHECKING:  # the strategies only order and pick groups: the config layer stays free of JAX
    from marinrl.train.replay.groups import BufferedGroup


def oldest_first(candidates: Sequence[BufferedGroup]) -> list[BufferedGroup]:
    return sorted(candidates, key=lambda g: (g.weight_step, g.seq))


@dataclasses.dataclass(frozen=True)
class SamplingConfig(draccus.ChoiceRegistry):
    """Which groups a step may use and which it takes. A registered choice (`type: off_policy`).

    A strategy has `max_staleness` (usable while `0 <= step - weight_step <= max_staleness`),
    `max_uses` (times one group may be trained on) and `choose(candidates, k, step, rng)`, which
    picks `k` of the usable `candidates` of one environment (there are always at least `k`).
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

    def choose(
        self, candidates: Sequence[BufferedGroup], k: int, step: int, rng: np.random.Generator
    ) -> list[BufferedGroup]:
        raise NotImplementedError

    def describe(self) -> str:
        name = SamplingConfig.get_choice_name(type(self))
        return f"{name} (max_staleness={self.max_staleness}, max_uses={self.max_uses})"


@SamplingConfig.register_subclass("on_policy")
@dataclasses.dataclass(frozen=True)
class OnPolicyConfig(SamplingConfig):
    """Exact on-policy: only groups of the trainer's current weights, each trained on once; the
    trainer waits for them."""

    @property
    def max_staleness(self) -> int:
        return 0

    @property
    def max_uses(self) -> int:
        return 1

    def choose(self, candidates, k, step, rng):
        return oldest_first(candidates)[:k]


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

    def choose(self, candidates, k, step, rng):
        return oldest_first(candidates)[:k]


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

    def choose(self, candidates, k, step, rng):
        ordered = oldest_first(candidates)
        weights = np.array([self.recency_decay ** (step - g.weight_step) for g in ordered], dtype=np.float64)
        # Weighted sampling without replacement: the k largest u^(1/w) (Efraimidis & Spirakis).
        keys = rng.random(len(ordered)) ** (1.0 / weights)
        picked = np.argsort(-keys, kind="stable")[:k]
        return [ordered[i] for i in sorted(picked)]
