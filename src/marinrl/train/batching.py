"""Rollouts → fixed-shape `TrainingBatch` of named arrays.

Alignment convention (every per-token field): index `t` describes the *target* token
`target_ids[t] = input_ids[t + 1]`, i.e. the token predicted from the logits at position `t`.
Padding rows (to fill a fixed batch size) have `loss_mask` 0 everywhere.

A row is one rollout: its prompt then its response, right-padded. With a prompt of `p` tokens and a
response of `r` tokens, response token `j` is `input_ids[p + j]`, so it is the target at position
`t = p - 1 + j`; `loss_mask`, `sampler_logprobs` and `advantages` of that token live at `t`. Prompt
tokens are never targets with a mask of 1, and neither are environment tokens of multi-turn episodes
(the rollout's own `loss_mask` is 0 there). `sampler_logprobs` and `advantages` are 0 wherever
`loss_mask` is 0, so a loss that forgets the mask still reads finite numbers.

The position axis is padded to one of a few bucket lengths (`BatchingConfig.bucket_lengths()`) so a
run compiles its step function once per bucket, not once per batch. Assembly is pure NumPy; the
arrays move to JAX in one `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from marinrl.types import Rollout

BATCH = "batch"
POSITION = "position"
PAD_ROW_WEIGHT_STEP = -1
"""`weight_step` of a padding row: no weights sampled it."""


class TrainingBatch(eqx.Module):
    """One optimizer step's worth of sequences, as named arrays over (batch, position)."""

    input_ids: hax.NamedArray  # [batch, position] int32: prompt + response tokens, right-padded
    target_ids: hax.NamedArray  # [batch, position] int32: input_ids shifted left by one
    loss_mask: hax.NamedArray  # [batch, position] float32: 1 where target_ids[t] is a trained response token
    sampler_logprobs: hax.NamedArray  # [batch, position] float32: log μ(target_ids[t]) at the sampling temperature
    advantages: hax.NamedArray  # [batch, position] float32: advantage credited to target_ids[t]
    temperature: hax.NamedArray  # [batch] float32: logits are divided by it so π_θ matches μ's distribution
    weight_step: hax.NamedArray  # [batch] int32: weights that sampled each row (for staleness metrics)

    @property
    def Batch(self) -> hax.Axis:
        return self.input_ids.resolve_axis("batch")

    @property
    def Pos(self) -> hax.Axis:
        return self.input_ids.resolve_axis("position")

    def row_mask(self) -> hax.NamedArray:
        """[batch] float32: 1 for a row with at least one trained token, 0 for a padding row."""
        return (hax.sum(self.loss_mask, self.Pos) > 0).astype(np.float32)

    @classmethod
    def from_rollouts(
        cls, rollouts: Sequence[Rollout], advantages, *, batch_size: int, config: BatchingConfig, trainable=None
    ) -> TrainingBatch:
        """See `make_training_batch`."""
        return make_training_batch(rollouts, advantages, batch_size=batch_size, config=config, trainable=trainable)

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray]) -> TrainingBatch:
        """Wraps the arrays of `pack_rollouts` as named arrays, moving them to JAX in one call."""
        on_device = jax.device_put(arrays)
        two_d = (BATCH, POSITION)
        return cls(
            input_ids=hax.named(on_device["input_ids"], two_d),
            target_ids=hax.named(on_device["target_ids"], two_d),
            loss_mask=hax.named(on_device["loss_mask"], two_d),
            sampler_logprobs=hax.named(on_device["sampler_logprobs"], two_d),
            advantages=hax.named(on_device["advantages"], two_d),
            temperature=hax.named(on_device["temperature"], (BATCH,)),
            weight_step=hax.named(on_device["weight_step"], (BATCH,)),
        )


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """How rollouts are laid out in a `TrainingBatch`."""

    max_length: int = 2048
    """Longest prompt + response a row can hold; the model's position axis must be at least this long."""
    buckets: Literal["geometric", "multiple"] = "geometric"
    """Row lengths a batch is padded to: `geometric` runs from `min_bucket` through powers of two with
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

    def __post_init__(self):
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
            raise ValueError(f"a sequence of {n_tokens} tokens does not fit max_length={self.max_length}")
        for length in self.bucket_lengths():
            if length >= n_tokens:
                return length
        raise AssertionError("unreachable: the last bucket is max_length")


def pack_rollouts(
    rollouts: Sequence[Rollout], advantages, *, batch_size: int, config: BatchingConfig, trainable=None
) -> dict[str, np.ndarray]:
    """The NumPy arrays of a `TrainingBatch` (same names), following the module's alignment convention.

    `advantages[i]` is rollout i's advantage, credited to every trained token of that rollout, or one
    advantage per response token (multi-turn credit, `advantages.token_advantages`).
    `trainable[i] = False` (e.g. a truncated response under DAPO's overlong masking) keeps the row but
    masks all of its tokens out.
    Rows beyond `len(rollouts)` are padding: ids `pad_token_id`, mask 0, temperature 1,
    weight_step `PAD_ROW_WEIGHT_STEP`.
    """
    n = len(rollouts)
    if len(advantages) != n:
        raise ValueError(f"advantages must have one entry per rollout ({n}), got {len(advantages)}")
    adv = []  # per rollout, one advantage per response token
    for i, (r, a) in enumerate(zip(rollouts, advantages)):
        a = np.asarray(a, dtype=np.float64)
        size = r.response_tokens.size
        if a.ndim == 0:
            a = np.full(size, a)
        elif a.shape != (size,):
            raise ValueError(f"advantages[{i}] must be a number or {size} per-token values (group "
                             f"{r.group_id!r}), got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"advantages[{i}] must be finite, got {a}")
        adv.append(a)
    train = np.ones(n, dtype=bool) if trainable is None else np.asarray(trainable)
    if train.shape != (n,) or train.dtype != np.bool_:
        raise ValueError(f"trainable must be {n} booleans to match the rollouts, got {trainable!r}")
    if n == 0:
        raise ValueError("cannot build a batch from zero rollouts")
    if n > batch_size:
        raise ValueError(f"{n} rollouts do not fit a batch of {batch_size} rows")
    for i, r in enumerate(rollouts):
        if r.prompt_tokens.size == 0:
            raise ValueError(f"rollout {i} (group {r.group_id!r}) has an empty prompt: the first response token "
                             f"needs at least one context token (a BOS) to be predicted from")
        if r.num_tokens > config.max_length:
            raise ValueError(f"rollout {i} (group {r.group_id!r}) has {r.num_tokens} tokens "
                             f"({r.prompt_tokens.size} prompt + {r.response_tokens.size} response), more than "
                             f"max_length={config.max_length}")
    length = config.bucket_for(max(r.num_tokens for r in rollouts))

    input_ids = np.full((batch_size, length), config.pad_token_id, dtype=np.int32)
    loss_mask = np.zeros((batch_size, length), dtype=np.float32)
    logprobs = np.zeros((batch_size, length), dtype=np.float32)
    adv_tokens = np.zeros((batch_size, length), dtype=np.float32)
    temperature = np.ones((batch_size,), dtype=np.float32)
    weight_step = np.full((batch_size,), PAD_ROW_WEIGHT_STEP, dtype=np.int32)
    for i, r in enumerate(rollouts):
        p, total = r.prompt_tokens.size, r.num_tokens
        input_ids[i, :p] = r.prompt_tokens
        input_ids[i, p:total] = r.response_tokens
        mask = r.loss_mask & train[i]  # bool, aligned with response tokens
        targets = slice(p - 1, total - 1)  # positions whose targets are the response tokens
        loss_mask[i, targets] = mask
        logprobs[i, targets] = np.where(mask, r.response_logprobs, 0.0)
        adv_tokens[i, targets] = np.where(mask, adv[i], 0.0)
        temperature[i] = r.temperature
        weight_step[i] = r.metadata.weight_step
    target_ids = np.full_like(input_ids, config.pad_token_id)
    target_ids[:, :-1] = input_ids[:, 1:]
    return {
        "input_ids": input_ids,
        "target_ids": target_ids,
        "loss_mask": loss_mask,
        "sampler_logprobs": logprobs,
        "advantages": adv_tokens,
        "temperature": temperature,
        "weight_step": weight_step,
    }


def make_training_batch(
    rollouts: Sequence[Rollout], advantages, *, batch_size: int, config: BatchingConfig, trainable=None
) -> TrainingBatch:
    """Packs rollouts (with one advantage each) into a `TrainingBatch` of `batch_size` rows.

    The position axis is the smallest bucket of `config` that holds the longest row, so every batch
    has one of `len(config.bucket_lengths())` shapes.
    """
    arrays = pack_rollouts(rollouts, advantages, batch_size=batch_size, config=config, trainable=trainable)
    return TrainingBatch.from_numpy(arrays)
