"""Reductions over a packed batch's tokens (named arrays [batch, position]): sums per response, token means, and
the loss's normalizations (`aggregate`). A row of a packed batch holds several responses told apart by
`sequence_ids` (batching.py); without them each row is one response. Notation: train/losses.py.
"""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from marinrl.config.loss import Normalization

BATCH = "batch"
POS = "position"


def sequence_sum(x: NamedArray, mask: NamedArray, sequence_ids: NamedArray | None = None) -> NamedArray:
    """Σ_{t' in the response of t} m_{t'} x_{t'} at every token t, shape [batch, position]: the sum over the
    masked tokens that share t's row and `sequence_ids` value (the whole row when `sequence_ids` is None).
    One scatter-add over (row, sequence) keys and a gather back; masked-out tokens add nothing."""
    m = mask.astype(bool)
    Batch, Pos = x.resolve_axis(BATCH), x.resolve_axis(POS)
    values = hax.where(m, x, 0.0).rearrange((Batch, Pos)).array.astype(jnp.float32)
    rows = jnp.arange(Batch.size, dtype=jnp.int32)[:, None] * Pos.size
    if sequence_ids is None:
        keys = jnp.broadcast_to(rows, (Batch.size, Pos.size))
    else:
        keys = rows + jnp.clip(sequence_ids.rearrange((Batch, Pos)).array, 0, Pos.size - 1)
    sums = jax.ops.segment_sum(values.reshape(-1), keys.reshape(-1), num_segments=Batch.size * Pos.size)
    return hax.named(sums[keys], (Batch, Pos))


def sequence_count(mask: NamedArray, sequence_ids: NamedArray | None) -> NamedArray:
    """|o_i| = Σ_t m_{i,t} at every token of response i, shape [batch, position]."""
    return sequence_sum(mask.astype(jnp.float32), mask, sequence_ids)


def masked_mean(x: NamedArray, mask: NamedArray) -> jax.Array:
    """Σ m·x / max(Σ m, 1) over every axis: a token-level mean that is 0 on an all-masked input."""
    m = mask.astype(bool)
    total = hax.sum(hax.where(m, x, 0.0)).array
    return total / jnp.maximum(hax.sum(m.astype(jnp.float32)).array, 1.0)


def aggregate(
    per_token: NamedArray, mask: NamedArray, normalization: Normalization, max_response_tokens: int | None = None,
    *, sequence_ids: NamedArray | None = None, sequence_slots: NamedArray | None = None,
) -> jax.Array:
    """Reduces per-token terms x_{i,t} of shape [batch, position] to one scalar:

        token:     Σ_{i,t} m x / N                                   (N = trained tokens in the batch)
        sequence:  (1/B') Σ_{i: |o_i|>0} (Σ_t m x / |o_i|)           (B' = responses with a trained token)
        constant:  Σ_{i,t} m x / (B · L_max)                         (B = rollout slots, empty ones included)

    Responses are told apart by `sequence_ids` (see `sequence_sum`); B is Σ `sequence_slots` (the rows when
    None). B' = Σ_t m_t / |o_{i(t)}|: each response with a trained token contributes 1.

    `constant` is Dr. GRPO's (1/G)(1/L_max) per group averaged over groups: no response's weight depends on
    its own length or on how many tokens the batch holds. Masked positions never contribute, whatever
    their values (even inf or NaN).
    """
    m = mask.astype(bool)
    x = hax.where(m, per_token, 0.0)
    if normalization == "token":
        return masked_mean(per_token, m)
    if normalization == "sequence":
        share = hax.where(m, 1.0 / hax.maximum(sequence_count(m, sequence_ids), 1.0), 0.0)
        nonempty = hax.sum(share).array
        return hax.sum(x * share).array / jnp.maximum(nonempty, 1.0)
    if normalization == "constant":
        if max_response_tokens is None:
            raise ValueError("constant normalization needs max_response_tokens")
        if sequence_slots is None:
            slots = float(per_token.resolve_axis(BATCH).size)
        else:
            slots = hax.sum(sequence_slots).array
        return hax.sum(x).array / (slots * max_response_tokens)
    raise ValueError(f"unknown normalization {normalization!r}")
