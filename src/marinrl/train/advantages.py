"""Group-relative advantages and reward shaping: pure NumPy functions, applied once when a group enters
the replay buffer (first `overlong_shaping`, then `group_advantages` on the shaped rewards), and the
per-token credit of multi-turn episodes (`token_advantages`), applied when a batch is packed.

Notation (docs/architecture.md, "The contracts"): a group of G responses to one prompt with rewards
R_1..R_G; r_{i,t} the reward a multi-turn environment placed on token t of response i (the last token of
the turn that earned it; `Rollout.token_rewards`).

To add an advantage estimator: write it below as a pure function of the group's rewards and their centred
values, with its formula in the docstring; register it in `ADVANTAGE_ESTIMATORS` and add its name to
`AdvantageKind` (config/loss.py, which `LossConfig.advantage` accepts); give `advantage_scale` its divisor
if it is not 1; add a NumPy reference to tests/test_replay.py.
"""

from __future__ import annotations

import math

import numpy as np

from marinrl.config.loss import AdvantageKind, OverlongMode


def group_advantages(rewards: np.ndarray, kind: AdvantageKind = "group_std", eps: float = 1e-6) -> np.ndarray:
    """Per-response advantages of one group.

    - `group_std` (GRPO):    A_i = (R_i − mean_j R_j) / (std_j R_j + eps)
    - `group_mean` (Dr. GRPO):  A_i = R_i − mean_j R_j
    - `rloo`:                A_i = R_i − mean_{j≠i} R_j  (0 for a group of one)

    Every kind sums to zero over the group, and a group whose rewards are all equal gets all zeros.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r}")
    if kind not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage kind {kind!r}; expected one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[kind](r, r - r.mean(), eps)


def group_std_advantages(rewards: np.ndarray, centered: np.ndarray, eps: float) -> np.ndarray:
    """GRPO: A_i = (R_i − mean_j R_j) / (std_j R_j + eps)."""
    return centered / (rewards.std() + eps)


def group_mean_advantages(rewards: np.ndarray, centered: np.ndarray, eps: float) -> np.ndarray:
    """Dr. GRPO: A_i = R_i − mean_j R_j."""
    return centered


def rloo_advantages(rewards: np.ndarray, centered: np.ndarray, eps: float) -> np.ndarray:
    """Leave-one-out: A_i = R_i − mean_{j≠i} R_j = (R_i − mean_j R_j) · G / (G − 1); 0 for a group of one."""
    g = rewards.size
    return centered * (g / (g - 1)) if g > 1 else np.zeros_like(rewards)


ADVANTAGE_ESTIMATORS = {"group_std": group_std_advantages, "group_mean": group_mean_advantages,
                        "rloo": rloo_advantages}
"""`LossConfig.advantage` → its estimator: (rewards, centred rewards, eps) → per-response advantages."""


def advantage_scale(rewards: np.ndarray, kind: AdvantageKind = "group_std", eps: float = 1e-6) -> float:
    """The divisor `group_advantages` applies to centred rewards (std + eps for `group_std`, 1 for the
    others), or inf for a group whose rewards are all equal: such a group carries no relative signal,
    and `token_advantages` then leaves its zero advantages untouched."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0 or np.all(r == r[0]):
        return math.inf
    return float(r.std() + eps) if kind == "group_std" else 1.0


def token_advantages(advantage: float, token_rewards: np.ndarray, scale: float) -> np.ndarray:
    """Per-token advantages of one response: A_{i,t} = A_i − (Σ_{s<t} r_{i,s}) / scale.

    Token t is credited only with the rewards earned at or after it (reward-to-go against the group's
    baseline): with group mean/std advantages, A_{i,t} = (Σ_{s≥t} r_{i,s} − mean_j R_j) / (std_j R_j + eps)
    when R_i = Σ_s r_{i,s}. A single-turn response (its reward on the last token) gets A_i on every
    token; in a multi-turn episode, the turns after a rewarded turn do not share its credit. The
    per-rollout reward shaping (overlong penalty) stays on every token. `scale` = `advantage_scale`."""
    r = np.asarray(token_rewards, dtype=np.float64)
    earned_before = np.cumsum(r) - r
    if not math.isfinite(scale) or not earned_before.any():
        return np.full(r.shape, advantage, dtype=np.float64)
    return advantage - earned_before / scale


def overlong_shaping(
    rewards: np.ndarray,
    response_lengths: np.ndarray,
    truncated: np.ndarray,
    *,
    mode: OverlongMode,
    max_response_tokens: int | None = None,
    cache_tokens: int = 0,
    penalty: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """DAPO's overlong reward shaping, per response; returns (shaped rewards, trainable).

    With L_max = `max_response_tokens`, L_cache = `cache_tokens`, |o_i| = `response_lengths[i]`:

    - `none`:    R_i unchanged; all trainable.
    - `mask`:    R_i unchanged; trainable_i = not truncated_i (finish_reason "length"). A truncated
                 response stays in its group's baseline but none of its tokens is trained.
    - `penalty`: R_i += R_len(|o_i|); all trainable, with
                   R_len(L) = 0                                          if L ≤ L_max − L_cache
                   R_len(L) = −penalty · (L − (L_max − L_cache)) / L_cache   if L_max − L_cache < L ≤ L_max
                   R_len(L) = −penalty                                   if L > L_max

    Apply it to a whole group before `group_advantages`, so the penalty moves the group baseline too.
    """
    r = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(response_lengths)
    trunc = np.asarray(truncated, dtype=bool)
    if r.ndim != 1 or lengths.shape != r.shape or trunc.shape != r.shape:
        raise ValueError(
            f"rewards, response_lengths and truncated must be 1-D of one length, got shapes "
            f"{r.shape}, {lengths.shape}, {trunc.shape}"
        )
    if lengths.size and (lengths.dtype.kind not in "iu" or lengths.min() < 0):
        raise ValueError(f"response_lengths must be non-negative integers, got {lengths}")
    if mode == "none":
        return r.copy(), np.ones(r.shape, dtype=bool)
    if mode == "mask":
        return r.copy(), ~trunc
    if mode == "penalty":
        if max_response_tokens is None or max_response_tokens <= 0:
            raise ValueError(f"overlong penalty needs max_response_tokens > 0, got {max_response_tokens}")
        if not 0 < cache_tokens <= max_response_tokens:
            raise ValueError(f"overlong penalty needs 0 < cache_tokens <= {max_response_tokens}, got {cache_tokens}")
        start = max_response_tokens - cache_tokens
        over = np.clip((lengths - start) / cache_tokens, 0.0, 1.0)
        return r - penalty * over, np.ones(r.shape, dtype=bool)
    raise ValueError(f"unknown overlong mode {mode!r}; expected one of none, mask, penalty")
