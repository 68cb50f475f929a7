"""Group-relative advantages: pure NumPy functions, computed once when a group enters the replay buffer.

Notation (DESIGN.md §3): a group of G responses to one prompt with rewards R_1..R_G.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

AdvantageKind = Literal["group_std", "group_mean", "rloo"]


def group_advantages(rewards: np.ndarray, kind: AdvantageKind = "group_std", eps: float = 1e-6) -> np.ndarray:
    """Per-response advantages of one group.

    - `group_std` (GRPO):    A_i = (R_i − mean_j R_j) / (std_j R_j + eps)
    - `group_mean` (Dr. GRPO, DAPO):  A_i = R_i − mean_j R_j
    - `rloo`:                A_i = R_i − mean_{j≠i} R_j  (0 for a group of one)

    Every kind sums to zero over the group, and a group whose rewards are all equal gets all zeros.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r}")
    centered = r - r.mean()
    if kind == "group_std":
        return centered / (r.std() + eps)
    if kind == "group_mean":
        return centered
    if kind == "rloo":
        g = r.size
        return centered * (g / (g - 1)) if g > 1 else np.zeros_like(r)
    raise ValueError(f"unknown advantage kind {kind!r}; expected one of group_std, group_mean, rloo")
