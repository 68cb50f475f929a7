"""Rollouts → fixed-shape `TrainingBatch` of named arrays.

Alignment convention (every per-token field): index `t` describes the *target* token
`target_ids[t] = input_ids[t + 1]`, i.e. the token predicted from the logits at position `t`.
Padding rows (to fill a fixed batch size) have `loss_mask` 0 everywhere.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax



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
