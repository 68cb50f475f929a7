"""`lora:` of a job config: LoRA adapters on a frozen base (docs/policies.md). The adapters themselves are
in lora.py."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from marinrl.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LoraRLConfig:
    """`lora:` in a job config: train LoRA adapters on a frozen base instead of every weight. Absent:
    full fine-tuning. Dropout is always 0: the trained policy must be the one the rollouts sampled."""

    rank: int = 8
    """r, the adapters' inner dimension (>= 1)."""
    alpha: float = 8.0
    """The adapter's output is scaled by alpha / rank (alpha = rank: scale 1)."""
    target_modules: Optional[str] = None
    """A regex searched in each linear module's dotted path (`transformer.layers.blocks.0.self_attn.q_proj`,
    `lm_head`; with scan layers `transformer.layers.stacked.mlp.up_proj`), e.g. `q_proj|v_proj`. None:
    every linear module (the recommendation of the QLoRA paper)."""
    seed: int = 0
    """PRNG seed of the adapters' A matrices (B starts at zero)."""

    def errors(self, field: str = "lora") -> None:
        """Raises ConfigError naming the first bad field under `field`."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"{field}.rank", f"must be an integer >= 1, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"{field}.alpha", f"must be finite and > 0, got {self.alpha!r}")
        if self.target_modules is not None:
            try:
                re.compile(self.target_modules)
            except re.error as e:
                raise ConfigError(f"{field}.target_modules", f"{self.target_modules!r} is not a regex: {e}") from e

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
