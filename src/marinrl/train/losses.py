"""GRPO-family policy losses: pure functions over named arrays (axes `batch` and `position`).

Notation (docs/architecture.md, "The contracts"). Response o_i is one rollout of a `TrainingBatch`; index t is
one target token (`target_ids[t]`, see batching.py for the alignment). m_{i,t} ∈ {0, 1} is the loss mask,
|o_i| = Σ_t m_{i,t} the trainable tokens of response i, N = Σ_{i,t} m_{i,t} those of the batch, B the number
of rollout slots. π_θ is the policy being trained (its logprobs carry the gradient), μ the sampler that produced the
tokens, π_old the trainer's own weights at the start of the step, π_ref a frozen reference.
A_{i,t} is the advantage credited to token t (computed per group at ingestion, advantages.py).
sg(·) is stop-gradient.

One objective, `LossConfig`, covers the family; `LossConfig.preset(name)` gives `grpo`, `dr_grpo`,
`dapo`, `gspo`, `cispo`. The pieces, each a pure function with its formula below:

  ratio        r_{i,t} = π_θ / anchor                                     `importance_ratio`
  correction   w_{i,t} = sg(TIS or MIS of π_old / μ)   (recomputed anchor) `importance_weight`
  per token    ℓ_{i,t} = −w · objective(r, A)                              `ppo_clip_objective`, `cispo_objective`
  KL           κ_{i,t} = k1 | k2 | k3 of π_θ against π_ref                   `kl_estimate`
  loss         L = agg(ℓ) + β · agg(κ)                                      `aggregate`, `loss_from_logprobs`

(`aggregate` and the per-response sums: reductions.py.)

`rl_loss(model, batch, config=...)` runs the policy forward (`token_logprobs`) and returns
`(loss, metrics)`: a Levanter `Trainer` loss function after `functools.partial(rl_loss, config=...)`.
The configuration and its presets are in config/loss.py, the model forward in policy_forward.py (both
re-exported here).

Rows of a packed batch hold several responses: every per-response quantity (|o_i|, the GSPO sequence ratio,
sequence-level corrections) is a sum over the tokens that share a `sequence_ids` value in a row
(`sequence_sum`, reductions.py); without `sequence_ids` each row is one response.
"""

from __future__ import annotations

import functools
import math

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.models.lm_model import LmHeadModel

from marinrl.config.loss import (  # noqa: F401  (re-exported)
    LOSS_PRESETS,
    Correction,
    CorrectionLevel,
    KLEstimator,
    LossConfig,
    Normalization,
    Objective,
    RatioAnchor,
    RatioLevel,
    describe,
)
from marinrl.train.batching import TrainingBatch
from marinrl.train.mismatch import mismatch_metrics
from marinrl.train.policy_forward import policy_forward, token_logprobs  # noqa: F401  (re-exported)
from marinrl.train.reductions import aggregate, masked_mean, sequence_count, sequence_sum

# --------------------------------------------------------------------------------------------------
# The pieces


def _stop(x: NamedArray) -> NamedArray:
    return jax.lax.stop_gradient(x)


def importance_ratio(
    logprobs: NamedArray, anchor_logprobs: NamedArray, mask: NamedArray, level: RatioLevel = "token",
    sequence_ids: NamedArray | None = None,
) -> NamedArray:
    """The policy ratio against an anchor (μ or π_old), per token, shape [batch, position].

    token:     r_{i,t} = exp(log π_θ(o_{i,t}) − log anchor(o_{i,t}))
    sequence:  r_{i,t} = sg(s_i) · π_θ(o_{i,t}) / sg(π_θ(o_{i,t})),   s_i = exp((1/|o_i|) Σ_t m_{i,t} log r_{i,t})

    The sequence form is GSPO's "token" formulation: every token of row i carries the value s_i and
    ∂r_{i,t}/∂log π_θ(o_{i,t}) = s_i, so under per-row mean normalization the gradient of
    min(r·A, clip(r)·A) equals that of GSPO's min(s_i·A_i, clip(s_i)·A_i) whenever A is constant along
    the row (and it still applies per-token advantages otherwise). Masked positions get ratio 1.
    """
    m = mask.astype(bool)
    log_r = hax.where(m, logprobs - anchor_logprobs, 0.0)
    if level == "token":
        return hax.exp(log_r)
    if level == "sequence":
        seq_log_r = sequence_sum(log_r, m, sequence_ids) / hax.maximum(sequence_count(m, sequence_ids), 1.0)
        lp = hax.where(m, logprobs, 0.0)
        return hax.where(m, hax.exp(_stop(seq_log_r) + lp - _stop(lp)), 1.0)
    raise ValueError(f"unknown ratio level {level!r}")


def importance_weight(
    old_logprobs: NamedArray,
    sampler_logprobs: NamedArray,
    mask: NamedArray,
    *,
    correction: Correction,
    level: CorrectionLevel = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    sequence_ids: NamedArray | None = None,
) -> tuple[NamedArray, NamedArray]:
    """Detached off-policy weight for staleness and sampler/trainer mismatch, and where it acted.

    token:     w_{i,t} = π_old(o_{i,t}) / μ(o_{i,t})
    sequence:  w_{i,t} = w_i = Π_t π_old(o_{i,t}) / μ(o_{i,t})   (the row's importance weight, over masked tokens)
    tis:       w ← min(w, C)                            affected = [w > C]
    mis:       w ← w · 1[α ≤ w ≤ β]                     affected = [w ∉ [α, β]]
    none:      w ← 1                                    affected = 0

    Computed in log space (no overflow for long rows) and under stop-gradient. Returns
    (weight, affected) with shape [batch, position]; masked positions get weight 1, affected 0.
    """
    m = mask.astype(bool)
    log_w = hax.where(m, _stop(old_logprobs) - _stop(sampler_logprobs), 0.0)
    if level == "sequence":
        log_w = sequence_sum(log_w, m, sequence_ids)
    elif level != "token":
        raise ValueError(f"unknown correction level {level!r}")
    if correction == "none":
        weight = hax.ones_like(log_w)
        affected = hax.zeros_like(log_w).astype(bool)
    elif correction == "tis":
        log_c = math.log(tis_cap)
        weight = hax.exp(hax.minimum(log_w, log_c))
        affected = log_w > log_c
    elif correction == "mis":
        lo = math.log(mis_low) if mis_low > 0 else -math.inf
        hi = math.log(mis_high)
        keep = (log_w >= lo) & (log_w <= hi)
        weight = hax.where(keep, hax.exp(hax.clip(log_w, max(lo, -1e4), hi)), 0.0)
        affected = ~keep
    else:
        raise ValueError(f"unknown correction {correction!r}")
    weight = hax.where(m, weight, 1.0)
    affected = m & affected
    return _stop(weight), affected


def ppo_clip_objective(ratio: NamedArray, advantages: NamedArray, eps_low: float, eps_high: float) -> NamedArray:
    """PPO's clipped surrogate per token (to be maximized), with asymmetric bounds:

        J_{i,t} = min(r_{i,t} · A_{i,t},  clip(r_{i,t}, 1 − ε_low, 1 + ε_high) · A_{i,t})

    The gradient is zero where the clip is active: r > 1 + ε_high with A > 0, or r < 1 − ε_low with A < 0.
    """
    return hax.minimum(ratio * advantages, hax.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages)


def cispo_objective(
    ratio: NamedArray, advantages: NamedArray, logprobs: NamedArray, eps_low: float, eps_high: float
) -> NamedArray:
    """CISPO's clipped-weight REINFORCE per token (to be maximized):

        J_{i,t} = sg(clip(r_{i,t}, 1 − ε_low, 1 + ε_high)) · A_{i,t} · log π_θ(o_{i,t})

    ∂J/∂log π_θ = clip(r)·A: a token's gradient is never dropped, only its weight bounded.
    """
    return _stop(hax.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)) * advantages * logprobs


def _ppo_clip(ratio, advantages, logprobs, eps_low, eps_high):
    clipped_low = (ratio < 1.0 - eps_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return ppo_clip_objective(ratio, advantages, eps_low, eps_high), clipped_low, clipped_high


def _cispo(ratio, advantages, logprobs, eps_low, eps_high):
    return (cispo_objective(ratio, advantages, logprobs, eps_low, eps_high), ratio < 1.0 - eps_low,
            ratio > 1.0 + eps_high)


OBJECTIVES = {"ppo": _ppo_clip, "cispo": _cispo}
"""`LossConfig.objective` → (ratio, A, log π_θ, ε_low, ε_high) → (J per token, where the clip is active below,
where it is active above: the `clip_low_frac`/`clip_high_frac` metrics). To add an objective: write its pure
function above with its formula, register it here, add its name to `Objective` and its words to
`OBJECTIVE_WORDS` (config/loss.py: the run header states it), a preset to `LOSS_PRESETS` if it has one, and a
NumPy reference to tests/test_losses.py."""


def kl_estimate(logprobs: NamedArray, reference_logprobs: NamedArray, estimator: KLEstimator = "k3") -> NamedArray:
    """Per-token estimate of KL(π_θ ‖ π_ref) on the sampled token, with δ = log π_ref − log π_θ:

        k1 = −δ                  (unbiased, can be negative)
        k2 = δ² / 2              (low variance, biased)
        k3 = e^δ − δ − 1         (≥ 0; GRPO's choice)

    The tokens were sampled from μ, not π_θ; as in GRPO, no importance correction is applied to the KL term.
    """
    delta = reference_logprobs - logprobs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return hax.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


# --------------------------------------------------------------------------------------------------
# The objective on per-token logprobs


def loss_from_logprobs(
    logprobs: NamedArray,
    *,
    sampler_logprobs: NamedArray,
    advantages: NamedArray,
    loss_mask: NamedArray,
    config: LossConfig,
    old_logprobs: NamedArray | None = None,
    reference_logprobs: NamedArray | None = None,
    sequence_ids: NamedArray | None = None,
    sequence_slots: NamedArray | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The configured loss from per-token logprobs of π_θ (all arrays [batch, position]; `sequence_ids` and
    `sequence_slots` as in `aggregate`: without them each row is one response).

        anchor   = μ (sampler) | π_old (recomputed; sg(π_θ) when `old_logprobs` is None)
        r        = importance_ratio(π_θ, anchor)                  (token or sequence level)
        w        = importance_weight(π_old, μ)  if recomputed, else 1   (detached)
        ℓ_{i,t}  = −w · J(r, A)                   J = ppo_clip_objective | cispo_objective
        L        = agg(ℓ) + β · agg(κ)             κ = kl_estimate(π_θ, π_ref), same normalization

    With the recomputed anchor and no `old_logprobs`, π_old is the detached current policy: exact when
    each batch gets one optimizer update from the weights that start the step (then r = 1, the clip is
    inactive, and w = π_θ/μ carries the whole off-policy correction, without an extra forward pass).
    Pass `old_logprobs` when the same batch is used for several updates.

    Returns (loss, metrics); every metric is a scalar and the set of keys does not depend on the config.
    Token fractions and means are over trained tokens (loss_mask = 1). `mismatch/*` (mismatch.py) compares
    μ with the trainer's logprobs at the start of the step (π_θ under the sampler anchor, π_old under the
    recomputed one) at the configured TIS/MIS bounds, whichever correction the loss applies.
    """
    m = loss_mask.astype(bool)
    lp = hax.where(m, logprobs, 0.0)
    mu = hax.where(m, sampler_logprobs, 0.0)
    adv = hax.where(m, advantages, 0.0)

    if config.ratio_anchor == "sampler":
        anchor = mu
    elif old_logprobs is None:
        anchor = _stop(lp)
    else:
        anchor = hax.where(m, _stop(old_logprobs), 0.0)
    ratio = importance_ratio(lp, anchor, m, config.ratio_level, sequence_ids)
    weight, affected = importance_weight(
        anchor,
        mu,
        m,
        correction=config.correction,
        level=config.correction_level,
        tis_cap=config.tis_cap,
        mis_low=config.mis_low,
        mis_high=config.mis_high,
        sequence_ids=sequence_ids,
    )
    agg = functools.partial(aggregate, normalization=config.normalization,
                            max_response_tokens=config.max_response_tokens, sequence_ids=sequence_ids,
                            sequence_slots=sequence_slots)

    if config.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {config.objective!r}; expected one of {', '.join(OBJECTIVES)}")
    objective, clipped_low, clipped_high = OBJECTIVES[config.objective](ratio, adv, lp, config.clip_eps_low,
                                                                         config.clip_eps_high)
    per_token = -weight * objective
    policy_loss = agg(per_token, m)

    if config.uses_reference and reference_logprobs is None:
        raise ValueError(f"kl_beta={config.kl_beta} needs reference_logprobs (a frozen reference model's logprobs)")
    if reference_logprobs is not None:
        kl_tok = kl_estimate(lp, hax.where(m, reference_logprobs, 0.0), config.kl_estimator)
        kl = agg(kl_tok, m)
    else:
        kl = jnp.zeros((), jnp.float32)
    kl_loss = config.kl_beta * kl if config.uses_reference else jnp.zeros((), jnp.float32)
    loss = policy_loss + kl_loss
    trainer_lp = anchor if config.ratio_anchor == "recomputed" else lp  # π_old, or π_θ at the step's start
    metrics = _loss_metrics(config, m, ratio=ratio, weight=weight, affected=affected, clipped_low=clipped_low,
                            clipped_high=clipped_high, trainer_lp=trainer_lp, mu=mu, sequence_ids=sequence_ids)
    metrics.update(policy_loss=policy_loss, kl_loss=kl_loss, kl=kl)
    return loss, metrics


def _loss_metrics(config: LossConfig, m: NamedArray, *, ratio, weight, affected, clipped_low, clipped_high,
                  trainer_lp: NamedArray, mu: NamedArray, sequence_ids: NamedArray | None) -> dict[str, jax.Array]:
    """The metrics of `loss_from_logprobs` besides the loss terms: where the clip and the correction acted, the
    ratio's range, and the sampler/trainer mismatch; every key present whatever the config."""
    num_tokens = hax.sum(m.astype(jnp.float32)).array
    r = _stop(ratio)
    has_tokens = num_tokens > 0
    seq_log_w = None
    if config.correction_level == "sequence":
        seq_log_w = sequence_sum(hax.where(m, _stop(trainer_lp) - mu, 0.0), m, sequence_ids)
    affected_frac = masked_mean(affected.astype(jnp.float32), m)
    metrics = {
        "clip_low_frac": masked_mean(clipped_low.astype(jnp.float32), m),
        "clip_high_frac": masked_mean(clipped_high.astype(jnp.float32), m),
        "ratio_mean": masked_mean(r, m),
        "ratio_min": jnp.where(has_tokens, hax.min(hax.where(m, r, jnp.inf)).array, 1.0),
        "ratio_max": jnp.where(has_tokens, hax.max(hax.where(m, r, -jnp.inf)).array, 1.0),
        **mismatch_metrics(trainer_lp, mu, m, tis_cap=config.tis_cap, mis_low=config.mis_low,
                           mis_high=config.mis_high, log_weight=seq_log_w),
        "is_weight_mean": masked_mean(weight, m),
        "is_truncated_frac": affected_frac if config.correction == "tis" else jnp.zeros((), jnp.float32),
        "is_masked_frac": affected_frac if config.correction == "mis" else jnp.zeros((), jnp.float32),
        "num_tokens": num_tokens,
    }
    return metrics


def rl_loss(
    model: LmHeadModel,
    batch: TrainingBatch,
    *,
    config: LossConfig,
    reference_logprobs: NamedArray | None = None,
    old_logprobs: NamedArray | None = None,
    key=None,
    lm_head_float32: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The configured GRPO-family loss of `model` on `batch`: `loss_from_logprobs` on `token_logprobs`.

    `reference_logprobs` (π_ref, required when kl_beta ≠ 0) and `old_logprobs` (π_old, optional under the
    recomputed anchor) are `token_logprobs` of those models on the same batch. Jittable; as a Levanter
    Trainer loss: `functools.partial(rl_loss, config=config)`. Metrics are those of `loss_from_logprobs`
    plus `entropy`, the mean entropy of π_θ (at the sampling temperature) on trained tokens.
    `lm_head_float32`: the head in float32 (`ModelConfig.lm_head_float32`, `policy_forward`).
    """
    logprobs, entropy, aux = policy_forward(model, batch, key=key, with_entropy=True, lm_head_float32=lm_head_float32)
    loss, metrics = loss_from_logprobs(
        logprobs,
        sampler_logprobs=batch.sampler_logprobs,
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        config=config,
        old_logprobs=old_logprobs,
        reference_logprobs=reference_logprobs,
        sequence_ids=batch.sequence_ids,
        sequence_slots=batch.sequence_slots,
    )
    metrics["entropy"] = masked_mean(entropy, batch.loss_mask)
    return loss + aux, metrics


