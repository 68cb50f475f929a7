"""The staleness window: which weight steps a trainer step may train on (docs/architecture.md, "The contracts").

The trainer about to apply update `step + 1` holds weights `step`; a group made with weights `w` has
staleness `step - w` and is usable while `0 <= step - w <= max_staleness` and, when `max_age_s` is
set, while its rollouts are at most that old on the wall clock. A group from the future (`w > step`)
is never trained on.

With in-flight weight updates the tokens of one rollout may come from several weight steps
(`Rollout.weight_steps`); a group's `w` is then a reduction over the steps of all its response
tokens (`TokenVersionReduction`), and "from the future" looks at its newest token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from marinrl.config.replay import TOKEN_VERSION_REDUCTIONS, TokenVersionReduction
from marinrl.types import RolloutGroup


def group_weight_step(group: RolloutGroup, reduction: TokenVersionReduction = "oldest") -> int:
    """The weight step staleness counts for `group`, over the steps of all its response tokens:
    `oldest` (the smallest: a group is as stale as its oldest token), `newest` (the largest), or
    `mean` (the token-weighted mean, rounded down: never fresher than the tokens are on average)."""
    steps = np.concatenate([r.token_weight_steps for r in group.rollouts])
    if reduction == "oldest":
        return int(steps.min())
    if reduction == "newest":
        return int(steps.max())
    if reduction == "mean":
        return int(np.floor(steps.mean()))
    raise ValueError(f"token_version_reduction must be one of {TOKEN_VERSION_REDUCTIONS}, got {reduction!r}")


def newest_weight_step(group: RolloutGroup) -> int:
    """The newest weight step any token of `group` was sampled with."""
    return max(int(r.token_weight_steps[-1]) for r in group.rollouts)  # steps never decrease in a rollout


@dataclasses.dataclass(frozen=True)
class StalenessWindow:
    """The window of one sampling strategy (`max_staleness`) and the buffer's `max_age_s`."""

    max_staleness: int
    """Largest `step - weight_step` a group may have."""
    max_age_s: float | None = None
    """Largest wall-clock age of a group's rollouts; None: no limit."""

    def oldest_step(self, step: int) -> int:
        """The oldest weight step still usable at `step`: the reader need not list below it."""
        return max(0, step - self.max_staleness)

    def contains(self, weight_step: int, step: int) -> bool:
        """Whether a group of `weight_step` may be trained on at `step` (neither stale nor from the future)."""
        return 0 <= step - weight_step <= self.max_staleness

    def expired(self, weight_step: int, created_at: float, step: int, now: float) -> str | None:
        """Why a group can never be used at `step` or later (`stale`, `too_old`); None if it still may be."""
        if step - weight_step > self.max_staleness:
            return "stale"
        if self.max_age_s is not None and now - created_at > self.max_age_s:
            return "too_old"
        return None

    @staticmethod
    def from_previous_run(weight_step: int, created_at: float, step: int, timeline_start: float) -> bool:
        """Whether a group newer than `step` was made before this run started: a previous run's future
        (after a restart from an older checkpoint), whose weights are not this run's. This run's newer
        weights only appear after `sample()` has moved the step on, so such groups of this run are held."""
        return weight_step > step and created_at < timeline_start
