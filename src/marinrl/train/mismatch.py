"""Sampler/trainer mismatch on the trained tokens: how far the logprobs the sampler stored (μ) are from the
trainer's own logprobs of the same tokens, as pure functions over named arrays [batch, position].

Rollouts are sampled in the inference dtype (bfloat16 at scale) by another program (the scan sampler or
Levanter's engine) than the trainer's forward, so even on-policy the two disagree a little; with
staleness > 0 the difference also holds the policy's change since the rollout's weights. The loss
computes these every step from values it already has (`losses.loss_from_logprobs`): π_trainer is the
policy's logprobs at the start of the step (the sampler anchor: the forward of the loss itself; the
recomputed anchor: π_old), so no extra forward pass. docs/training.md, "Sampler/trainer mismatch".

Notation: m_t ∈ {0, 1} the loss mask, N = Σ_t m_t, d_t = log π_trainer(o_t) − log μ(o_t).
"""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray

from marinrl.train.reductions import masked_mean

PREFIX = "mismatch/"
"""The metrics' prefix: Levanter logs them as `train/mismatch/<name>`."""
NAMES = ("abs_logprob_mean", "abs_logprob_max", "k3_kl", "tis_clipped_frac", "mis_masked_frac")


def log_ratio(trainer_logprobs: NamedArray, sampler_logprobs: NamedArray, mask: NamedArray) -> NamedArray:
    """d_t = m_t · (log π_trainer(o_t) − log μ(o_t)), detached: 0 off the trained tokens (whatever they hold)."""
    m = mask.astype(bool)
    return jax.lax.stop_gradient(hax.where(m, trainer_logprobs - sampler_logprobs, 0.0))


def k3(d: NamedArray) -> NamedArray:
    """k3 = e^d − d − 1 (≥ 0, 0 only at d = 0): per token, an unbiased estimate of KL(μ ‖ π_trainer) on tokens
    sampled from μ, since E_μ[π/μ − 1] = 0 and E_μ[−log(π/μ)] = KL(μ ‖ π)."""
    return hax.exp(d) - d - 1.0


def mismatch_metrics(
    trainer_logprobs: NamedArray,
    sampler_logprobs: NamedArray,
    mask: NamedArray,
    *,
    tis_cap: float,
    mis_low: float,
    mis_high: float,
    log_weight: NamedArray | None = None,
) -> dict[str, jax.Array]:
    """The mismatch metrics (scalars, keys `mismatch/<name>`), whatever correction the loss applies:

        abs_logprob_mean  = Σ_t m_t |d_t| / N
        abs_logprob_max   = max_{t: m_t = 1} |d_t|                 (0 without trained tokens)
        k3_kl             = Σ_t m_t (e^{d_t} − d_t − 1) / N          (`k3`)
        tis_clipped_frac  = Σ_t m_t [log w_t > log C] / N           (C = tis_cap: tokens TIS would truncate)
        mis_masked_frac   = Σ_t m_t [log w_t ∉ [log α, log β]] / N   (α, β = mis_low, mis_high: MIS would drop)

    log w_t = `log_weight` (the importance weight's log at the loss's correction level, e.g. a row's sum of
    d under sequence-level TIS/MIS), else d_t (token level). Every fraction is over trained tokens.
    """
    m = mask.astype(bool)
    d = log_ratio(trainer_logprobs, sampler_logprobs, m)
    log_w = d if log_weight is None else hax.where(m, jax.lax.stop_gradient(log_weight), 0.0)
    has_tokens = hax.sum(m.astype(jnp.float32)).array > 0
    abs_d = hax.abs(d)
    lo = math.log(mis_low) if mis_low > 0 else -math.inf
    hi = math.log(mis_high)
    metrics = {
        "abs_logprob_mean": masked_mean(abs_d, m),
        "abs_logprob_max": jnp.where(has_tokens, hax.max(hax.where(m, abs_d, 0.0)).array, 0.0),
        "k3_kl": masked_mean(k3(d), m),
        "tis_clipped_frac": masked_mean((log_w > math.log(tis_cap)).astype(jnp.float32), m),
        "mis_masked_frac": masked_mean(((log_w < lo) | (log_w > hi)).astype(jnp.float32), m),
    }
    return {PREFIX + k: v for k, v in metrics.items()}
