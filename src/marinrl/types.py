"""The rollout data model: what crosses from the rollout side to the trainer.

Token ids, not strings, are the source of truth (docs/architecture.md, "The contracts"). Every object checks
itself when it is built, so a bad rollout fails where it was made, with the field named, instead of deep
inside a jitted loss three processes later.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Literal, Optional, Sequence

import numpy as np

FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length")
DEFAULT_POLICY = "policy"
DEFAULT_AGENT = "agent"


class RolloutValidationError(ValueError):
    """A rollout, group or batch whose fields contradict each other."""


def _fail(owner: str, field: str, problem: str) -> None:
    raise RolloutValidationError(f"{owner}.{field}: {problem}")


def _as_1d(owner: str, field: str, value, dtype) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        _fail(owner, field, f"cannot be read as {np.dtype(dtype).name}: {e}")
    if arr.ndim != 1:
        _fail(owner, field, f"must be one-dimensional, got shape {arr.shape}")
    return arr


def _check_tokens(owner: str, field: str, value) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        _fail(owner, field, f"token ids must be integers, got dtype {value.dtype}")
    arr = _as_1d(owner, field, value, np.int64)
    if arr.size and arr.min() < 0:
        _fail(owner, field, f"token ids must be >= 0, got {int(arr.min())}")
    if arr.size and arr.max() > np.iinfo(np.int32).max:
        _fail(owner, field, f"token id {int(arr.max())} does not fit in int32")
    return arr.astype(np.int32)


def _check_finite(owner: str, field: str, arr: np.ndarray) -> None:
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        _fail(owner, field, f"must be finite, got {arr[bad]} at index {bad}")


def check_weight_steps(owner: str, value, n: int, start_step: int) -> np.ndarray:
    """`Rollout.weight_steps` as int64, checked: one per response token, >= `start_step` (the rollout's
    `metadata.weight_step`), never decreasing (weights only move forward while a rollout is sampled)."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in "iu":
        _fail(owner, "weight_steps", f"must be integers, got dtype {value.dtype}")
    arr = _as_1d(owner, "weight_steps", value, np.int64)
    if arr.size != n:
        _fail(owner, "weight_steps", f"has length {arr.size} but response_tokens has length {n}")
    if arr.size and arr.min() < start_step:
        _fail(owner, "weight_steps", f"holds step {int(arr.min())}, below the rollout's metadata.weight_step "
                                     f"{start_step} (the weights it began with)")
    if arr.size > 1 and np.any(np.diff(arr) < 0):
        bad = int(np.flatnonzero(np.diff(arr) < 0)[0])
        _fail(owner, "weight_steps", f"decreases from {int(arr[bad])} to {int(arr[bad + 1])} at index {bad + 1}: "
                                     "weights only move forward within a rollout")
    return arr


@dataclasses.dataclass(frozen=True)
class RolloutMetadata:
    """Who made a rollout, with which weights, and when."""

    worker_id: str
    weight_step: int
    created_at: float = dataclasses.field(default_factory=time.time)

    def __post_init__(self):
        if not isinstance(self.worker_id, str) or not self.worker_id:
            _fail("RolloutMetadata", "worker_id", f"must be a non-empty string, got {self.worker_id!r}")
        if isinstance(self.weight_step, bool) or not isinstance(self.weight_step, (int, np.integer)):
            _fail("RolloutMetadata", "weight_step", f"must be an int, got {self.weight_step!r}")
        if self.weight_step < 0:
            _fail("RolloutMetadata", "weight_step", f"must be >= 0, got {self.weight_step}")
        object.__setattr__(self, "weight_step", int(self.weight_step))
        if not np.isfinite(self.created_at):
            _fail("RolloutMetadata", "created_at", f"must be finite, got {self.created_at}")
        object.__setattr__(self, "created_at", float(self.created_at))


@dataclasses.dataclass(frozen=True, eq=False)
class Rollout:
    """One sampled response to one prompt, with everything the loss needs.

    Per-token arrays (`response_logprobs`, `loss_mask`, `token_rewards`, `weight_steps`) are aligned
    with `response_tokens`. The stop token the model sampled is part of the response: stopping is an
    action and is trained. In multi-turn episodes, environment tokens sit inside the response with
    `loss_mask` 0 (their logprobs are then ignored).
    """

    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    response_logprobs: np.ndarray
    """log μ(token) under the sampler, at `temperature`."""
    temperature: float
    loss_mask: np.ndarray
    """1 where the token was produced by the policy and is trained; 0 for context."""
    token_rewards: np.ndarray
    """Reward credited to each response token; an episode reward sits on the last one."""
    episode_reward: float
    finish_reason: FinishReason
    env_name: str
    lesson_id: str
    group_id: str
    """Global id of the prompt: rollouts with the same group_id are compared with each other."""
    metadata: RolloutMetadata
    agent_name: str = DEFAULT_AGENT
    policy_name: str = DEFAULT_POLICY
    weight_steps: Optional[np.ndarray] = None
    """Weight step of the weights that sampled each response token, when weights were swapped while the
    rollout was generated (in-flight updates, docs/weight_transfer.md); environment tokens carry the step
    of the token before them. Never below `metadata.weight_step` (the weights the rollout began with)
    and never decreasing. None: every token at `metadata.weight_step` (`token_weight_steps`)."""

    def __post_init__(self):
        o = "Rollout"
        set_ = object.__setattr__
        set_(self, "prompt_tokens", _check_tokens(o, "prompt_tokens", self.prompt_tokens))
        response = _check_tokens(o, "response_tokens", self.response_tokens)
        if response.size == 0:
            _fail(o, "response_tokens", "is empty: a rollout must contain at least one sampled token")
        set_(self, "response_tokens", response)
        n = response.size
        for field, dtype in (("response_logprobs", np.float32), ("token_rewards", np.float32)):
            arr = _as_1d(o, field, getattr(self, field), dtype)
            if arr.size != n:
                _fail(o, field, f"has length {arr.size} but response_tokens has length {n}")
            _check_finite(o, field, arr)
            set_(self, field, arr)
        if np.any(self.response_logprobs > 1e-4):
            _fail(o, "response_logprobs", f"log-probabilities must be <= 0, got {self.response_logprobs.max()}")
        mask = _as_1d(o, "loss_mask", self.loss_mask, np.float64)
        if mask.size != n:
            _fail(o, "loss_mask", f"has length {mask.size} but response_tokens has length {n}")
        if not np.all((mask == 0) | (mask == 1)):
            _fail(o, "loss_mask", "must contain only 0 and 1")
        set_(self, "loss_mask", mask.astype(np.bool_))
        for field in ("temperature", "episode_reward"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not np.isfinite(value):
                _fail(o, field, f"must be a finite number, got {value!r}")
            set_(self, field, float(value))
        if self.temperature < 0:
            _fail(o, "temperature", f"must be >= 0, got {self.temperature}")
        if self.finish_reason not in FINISH_REASONS:
            _fail(o, "finish_reason", f"must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        for field in ("env_name", "lesson_id", "group_id", "agent_name", "policy_name"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                _fail(o, field, f"must be a non-empty string, got {value!r}")
        if not isinstance(self.metadata, RolloutMetadata):
            _fail(o, "metadata", f"must be a RolloutMetadata, got {type(self.metadata).__name__}")
        if self.weight_steps is not None:
            set_(self, "weight_steps", check_weight_steps(o, self.weight_steps, n, self.metadata.weight_step))

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_tokens.size + self.response_tokens.size)

    @property
    def token_weight_steps(self) -> np.ndarray:
        """int64 [len(response_tokens)]: the weight step that sampled each response token."""
        if self.weight_steps is not None:
            return self.weight_steps
        return np.full(self.response_tokens.size, self.metadata.weight_step, dtype=np.int64)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Rollout):
            return NotImplemented
        for f in dataclasses.fields(self):
            if f.name == "weight_steps":  # None and the array it stands for are the same rollout
                a, b = self.token_weight_steps, other.token_weight_steps
            else:
                a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """All samples of one prompt: the unit group-relative advantages are computed over."""

    rollouts: tuple[Rollout, ...]

    def __post_init__(self):
        rollouts = tuple(self.rollouts)
        if not rollouts:
            _fail("RolloutGroup", "rollouts", "is empty: a group needs at least one rollout")
        for i, r in enumerate(rollouts):
            if not isinstance(r, Rollout):
                _fail("RolloutGroup", f"rollouts[{i}]", f"must be a Rollout, got {type(r).__name__}")
        ids = {r.group_id for r in rollouts}
        if len(ids) != 1:
            _fail("RolloutGroup", "rollouts", f"mixes group_ids {sorted(ids)}; one group is one prompt")
        object.__setattr__(self, "rollouts", rollouts)

    @property
    def group_id(self) -> str:
        return self.rollouts[0].group_id

    @property
    def rewards(self) -> np.ndarray:
        return np.array([r.episode_reward for r in self.rollouts], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.rollouts)


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """What one RolloutManager call returns, and what one rollout file holds.

    All rollouts of a batch were made by one worker and began with one set of weights, so the batch's
    weight step can name the file without opening it (with in-flight weight updates, later tokens of a
    rollout may come from newer weights: `Rollout.weight_steps`).
    """

    groups: tuple[RolloutGroup, ...]
    metadata: RolloutMetadata

    def __post_init__(self):
        groups = tuple(self.groups)
        if not groups:
            _fail("RolloutBatch", "groups", "is empty: a batch needs at least one group")
        if not isinstance(self.metadata, RolloutMetadata):
            _fail("RolloutBatch", "metadata", f"must be a RolloutMetadata, got {type(self.metadata).__name__}")
        seen: set[str] = set()
        for i, g in enumerate(groups):
            if not isinstance(g, RolloutGroup):
                _fail("RolloutBatch", f"groups[{i}]", f"must be a RolloutGroup, got {type(g).__name__}")
            if g.group_id in seen:
                _fail("RolloutBatch", f"groups[{i}]", f"repeats group_id {g.group_id!r}")
            seen.add(g.group_id)
            for r in g.rollouts:
                if r.metadata.weight_step != self.metadata.weight_step:
                    _fail(
                        "RolloutBatch",
                        f"groups[{i}]",
                        f"holds a rollout of weight_step {r.metadata.weight_step} in a batch of "
                        f"weight_step {self.metadata.weight_step}",
                    )
        object.__setattr__(self, "groups", groups)

    @property
    def weight_step(self) -> int:
        return self.metadata.weight_step

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)


def group_rollouts(rollouts: Sequence[Rollout]) -> list[RolloutGroup]:
    """Groups rollouts by `group_id`, keeping first-seen order."""
    by_id: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_id.setdefault(r.group_id, []).append(r)
    return [RolloutGroup(tuple(rs)) for rs in by_id.values()]


def version_spread_metrics(rollouts: Iterable[Rollout], prefix: str) -> dict[str, float]:
    """How many weight versions apart the first and last token of each rollout are: `<prefix>/version_spread_max`
    and `_mean` (0 without in-flight updates), and the share of rollouts with more than one version."""
    spreads = np.array([int(s[-1] - s[0]) for s in (r.token_weight_steps for r in rollouts)], dtype=np.float64)
    if spreads.size == 0:
        return {}
    return {f"{prefix}/version_spread_max": float(spreads.max()),
            f"{prefix}/version_spread_mean": float(spreads.mean()),
            f"{prefix}/mixed_version_frac": float(np.mean(spreads > 0))}
