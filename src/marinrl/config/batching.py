"""`batching:` of a job config: how rollouts are laid out in a training batch's rows (train/batching.py,
docs/training.md)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

Layout = Literal["shared", "packed", "padded"]


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """How rollouts are laid out in a `TrainingBatch` (see the module docstring)."""

    max_length: int = 2048
    """The row budget: the most tokens a row holds. Every rollout (prompt + response) must fit one row;
    preflight checks it against the model's position axis."""
    layout: Layout = "shared"
    """`shared` (default): a group's rollouts form one block, its prompt computed once and every response
    attending to it (split at response boundaries, the prompt repeated, when the block does not fit a row):
    11x the trained tokens/s of `padded` at the realistic benchmark shape (docs/performance.md). `packed`:
    every rollout is its own block, rows filled first-fit decreasing. `padded`: one rollout per row and one
    row per rollout slot, all as long as the longest (the benchmark's reference layout)."""
    buckets: Literal["geometric", "multiple"] = "geometric"
    """Row lengths a batch can have: `geometric` runs from `min_bucket` through powers of two with
    a step at 1.5x inside each octave (16, 24, 32, 48, 64, 96, 128, ...), so padding never adds more
    than half a row (a pure doubling ladder pads a 65-token batch to 128) for one extra compile per
    octave; `multiple` steps by `bucket_multiple` from `min_bucket` (64, 128, 192, ...). The last
    bucket is always `max_length`."""
    min_bucket: int = 16
    """The shortest bucket."""
    bucket_multiple: int = 64
    """Step between buckets when `buckets` is `multiple`."""
    pad_token_id: int = 0
    """Token id written into padding positions (never trained: its mask is 0)."""
    attention_break_even: Optional[int] = None
    """Under `shared`, each batch's row length is the bucket that minimizes rows × L × (L + this): long rows
    share a group's prompt among more responses, short rows attend over fewer keys (attention grows with L²,
    the rest of a layer with L). Measured on XLA:CPU (docs/performance.md) the two cost the same near
    L ≈ 3 × the model's hidden size. None: the trainer sets it from its model (3 × hidden_dim); 384 where no
    model is known."""

    def __post_init__(self):
        if self.layout not in ("shared", "packed", "padded"):
            raise ValueError(f"BatchingConfig.layout must be 'shared', 'packed' or 'padded', got {self.layout!r}")
        if self.buckets not in ("geometric", "multiple"):
            raise ValueError(f"BatchingConfig.buckets must be 'geometric' or 'multiple', got {self.buckets!r}")
        for name in ("max_length", "min_bucket", "bucket_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchingConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 2:
            raise ValueError(f"BatchingConfig.max_length must be >= 2 (a prompt token and a response token), "
                             f"got {self.max_length}")
        if self.pad_token_id < 0:
            raise ValueError(f"BatchingConfig.pad_token_id must be >= 0, got {self.pad_token_id}")
        if self.attention_break_even is not None and self.attention_break_even < 1:
            raise ValueError(f"BatchingConfig.attention_break_even must be >= 1 (or null), got "
                             f"{self.attention_break_even}")

    def for_model(self, hidden_dim: int | None) -> BatchingConfig:
        """This config with `attention_break_even` set from the model's hidden size, unless the user set it."""
        if self.attention_break_even is not None or not hidden_dim:
            return self
        return dataclasses.replace(self, attention_break_even=3 * int(hidden_dim))

    def bucket_lengths(self) -> tuple[int, ...]:
        """All row lengths a batch can have, ascending; the last is `max_length`."""
        lengths = []
        length = self.min_bucket
        while length < self.max_length:
            lengths.append(length)
            if self.buckets == "multiple":
                length += self.bucket_multiple
            else:  # the next of 2^k and 1.5 * 2^k above `length`
                octave = 1 << (length.bit_length() - 1)
                length = octave * 3 // 2 if length < octave * 3 // 2 else octave * 2
        lengths.append(self.max_length)
        return tuple(lengths)

    def bucket_for(self, n_tokens: int) -> int:
        """The shortest bucket that holds `n_tokens`; a ValueError past `max_length`."""
        if n_tokens > self.max_length:
            raise ValueError(f"a sequence of {n_tokens} tokens does not fit "
                             f"BatchingConfig.max_length={self.max_length}")
        for length in self.bucket_lengths():
            if length >= n_tokens:
                return length
        raise AssertionError("unreachable: the last bucket is max_length")
