"""`inflight:` of a job config: rollout workers take newer weights while a batch is generated
(docs/weight_transfer.md). The swaps themselves are in inflight.py."""

from __future__ import annotations

import dataclasses
from typing import Literal

InflightKV = Literal["keep", "recompute"]
INFLIGHT_KV: tuple[str, ...] = ("keep", "recompute")


@dataclasses.dataclass(frozen=True)
class InflightConfig:
    """In-flight weight updates (`inflight:` in the job config): rollout workers take newer weights while
    a batch is being generated instead of only between batches (docs/weight_transfer.md)."""

    enabled: bool = False
    """Swap weights inside a batch's generation. Off: weights change only between batches. Needs
    max_staleness >= 1 (on-policy never mixes weight versions inside a rollout) and the scan backend."""
    swap_every_tokens: int = 16
    """Decode steps between chances to swap: smaller picks up new weights sooner, at one host round
    trip (and a weight-source poll) per chunk."""
    kv: InflightKV = "keep"
    """After a swap: `keep` the running sequences' KV cache as the old weights wrote it (free), or
    `recompute` it with the new weights (one prefill of each sequence so far)."""

    def __post_init__(self):
        if isinstance(self.swap_every_tokens, bool) or self.swap_every_tokens < 1:
            raise ValueError(f"inflight.swap_every_tokens must be >= 1, got {self.swap_every_tokens!r}")
        if self.kv not in INFLIGHT_KV:
            raise ValueError(f"inflight.kv must be one of {INFLIGHT_KV}, got {self.kv!r}")
