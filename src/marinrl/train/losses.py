"""GRPO-family policy losses: pure functions over named arrays (axes `batch` and `position`).

Notation (docs/architecture.md, "The contracts"). Row i of a `TrainingBatch` is one response o_i; index t is one target token
(`target_ids[t]`, see batching.py for the alignment). m_{i,t} ∈ {0, 1} is the loss mask, |o_i| = Σ_t m_{i,t}
the trainable tokens of row i, N = Σ_{i,t} m_{i,t} those of the batch, B the number of rows.
π_θ is the policy being trained (its logprobs carry the gradient), μ the sampler that produced the
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

`rl_loss(model, batch, config=...)` runs the policy forward (`token_logprobs`) and returns
`(loss, metrics)`: a Levanter `Trainer` loss function after `functools.partial(rl_loss, config=...)`.
`describe(config)` is the one-line header every run prints.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Literal, Mapping, get_args

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel
from levanter.models.loss import fused_cross_entropy_loss_and_logsumexp_penalty

from marinrl.train.advantages import AdvantageKind, OverlongMode
from marinrl.train.batching import TrainingBatch

BATCH = "batch"
POS = "position"

Objective = Literal["ppo", "cispo"]
RatioLevel = Literal["token", "sequence"]
Normalization = Literal["token", "sequence", "constant"]
RatioAnchor = Literal["sampler", "recomputed"]
Correction = Literal["none", "tis", "mis"]
CorrectionLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]


# --------------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The GRPO-family objective. Defaults are the `grpo` preset; see `LOSS_PRESETS` for the others.

    Fields used by the loss itself come first; the last group (`advantage`, `drop_zero_variance_groups`,
    `overlong*`) is applied by the replay buffer when rollouts are ingested, and lives here because it is
    part of what a preset means.
    """

    objective: Objective = "ppo"
    """`ppo`: w · min(r·A, clip(r, 1−ε_low, 1+ε_high)·A).
    `cispo`: w · sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π_θ."""
    ratio_level: RatioLevel = "token"
    """`token`: r_{i,t} = π_θ(o_{i,t}) / anchor(o_{i,t}). `sequence` (GSPO): s_i = exp(mean_t log r_{i,t}), used by
    every token of the row."""
    normalization: Normalization = "sequence"
    """How per-token terms become one number. `token`: Σ ℓ / N (one token-level mean over the batch).
    `sequence`: mean over non-empty rows of (Σ_t ℓ_{i,t} / |o_i|).
    `constant`: Σ ℓ / (B · max_response_tokens)."""
    clip_eps_low: float = 0.2
    """Lower clip bound 1 − ε_low on the ratio (1.0 means no lower bound)."""
    clip_eps_high: float = 0.2
    """Upper clip bound 1 + ε_high on the ratio (DAPO's clip-higher uses 0.28)."""
    ratio_anchor: RatioAnchor = "sampler"
    """`sampler`: r = π_θ / μ, from the logprobs stored in the rollout (no extra forward pass).
    `recomputed` (decoupled PPO): r = π_θ / π_old, times the detached importance weight w of `correction`."""
    correction: Correction = "none"
    """Importance weight w = π_old / μ under the `recomputed` anchor. `tis`: min(w, tis_cap).
    `mis`: w · 1[mis_low ≤ w ≤ mis_high]. `none`: w = 1."""
    correction_level: CorrectionLevel = "token"
    """`token`: w per token. `sequence`: one w_i = Π_t π_old(o_{i,t}) / μ(o_{i,t}) per row, applied to all
    its tokens."""
    tis_cap: float = 2.0
    """C of truncated importance sampling, min(w, C)."""
    mis_low: float = 0.5
    """α of masked importance sampling: tokens (rows) with w < α get weight 0."""
    mis_high: float = 2.0
    """β of masked importance sampling: tokens (rows) with w > β get weight 0."""
    kl_beta: float = 0.0
    """β of the KL term added to the loss. 0 means no KL and no reference model is built."""
    kl_estimator: KLEstimator = "k3"
    """Per-token estimator of KL(π_θ ‖ π_ref), δ = log π_ref − log π_θ: k1 = −δ, k2 = δ²/2, k3 = e^δ − δ − 1."""
    max_response_tokens: int | None = None
    """The generation budget L_max (response tokens). Needed by `constant` normalization and `penalty` overlong
    shaping; ignored otherwise."""

    advantage: AdvantageKind = "group_std"
    """Group advantage computed at ingestion (advantages.group_advantages): group_std, group_mean or rloo."""
    drop_zero_variance_groups: bool = False
    """DAPO dynamic sampling: the replay buffer drops groups whose rewards are all equal."""
    overlong: OverlongMode = "none"
    """DAPO overlong shaping at ingestion (advantages.overlong_shaping): `none`, `mask` (truncated responses are
    not trained) or `penalty` (linear penalty over the last `overlong_cache_tokens` of the budget)."""
    overlong_cache_tokens: int = 0
    """L_cache of the overlong penalty: it ramps from 0 at L_max − L_cache to −overlong_penalty at L_max."""
    overlong_penalty: float = 1.0
    """Size of the overlong penalty at the budget."""

    def __post_init__(self):
        for field, alias in (
            ("objective", Objective),
            ("ratio_level", RatioLevel),
            ("normalization", Normalization),
            ("ratio_anchor", RatioAnchor),
            ("correction", Correction),
            ("correction_level", CorrectionLevel),
            ("kl_estimator", KLEstimator),
            ("advantage", AdvantageKind),
            ("overlong", OverlongMode),
        ):
            value = getattr(self, field)
            if value not in get_args(alias):
                raise ValueError(f"LossConfig.{field}: {value!r} is not one of {get_args(alias)}")
        if not 0.0 <= self.clip_eps_low <= 1.0:
            raise ValueError(f"LossConfig.clip_eps_low: must be in [0, 1], got {self.clip_eps_low}")
        if not self.clip_eps_high >= 0.0:
            raise ValueError(f"LossConfig.clip_eps_high: must be >= 0, got {self.clip_eps_high}")
        if self.correction != "none" and self.ratio_anchor != "recomputed":
            raise ValueError(
                f"LossConfig.correction: {self.correction!r} corrects π_old/μ and needs ratio_anchor='recomputed'; "
                "with the sampler anchor the ratio π_θ/μ already includes the mismatch"
            )
        if not self.tis_cap > 0:
            raise ValueError(f"LossConfig.tis_cap: must be > 0, got {self.tis_cap}")
        if not 0.0 <= self.mis_low < self.mis_high:
            raise ValueError(
                f"LossConfig.mis_low/mis_high: need 0 <= mis_low < mis_high, got {self.mis_low}, {self.mis_high}"
            )
        if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"LossConfig.kl_beta: must be finite and >= 0, got {self.kl_beta}")
        if self.max_response_tokens is not None and self.max_response_tokens <= 0:
            raise ValueError(f"LossConfig.max_response_tokens: must be > 0, got {self.max_response_tokens}")
        if self.normalization == "constant" and self.max_response_tokens is None:
            raise ValueError(
                "LossConfig.max_response_tokens: normalization='constant' divides by B × max_response_tokens; "
                "set it to the generation budget (the lesson's max new tokens)"
            )
        if self.overlong == "penalty":
            if self.max_response_tokens is None:
                raise ValueError("LossConfig.max_response_tokens: overlong='penalty' needs the generation budget")
            if not 0 < self.overlong_cache_tokens <= self.max_response_tokens:
                raise ValueError(
                    "LossConfig.overlong_cache_tokens: must be in "
                    f"(0, max_response_tokens={self.max_response_tokens}], "
                    f"got {self.overlong_cache_tokens}"
                )
        if not self.overlong_penalty >= 0:
            raise ValueError(f"LossConfig.overlong_penalty: must be >= 0, got {self.overlong_penalty}")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss needs reference logprobs (and the run a frozen reference model)."""
        return self.kl_beta != 0.0

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "LossConfig":
        """A named preset of `LOSS_PRESETS`, with fields overridden by keyword (e.g. `max_response_tokens=512`)."""
        if name not in LOSS_PRESETS:
            raise ValueError(f"unknown loss preset {name!r}; expected one of {sorted(LOSS_PRESETS)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"LossConfig has no field(s) {sorted(unknown)}")
        return cls(**{**LOSS_PRESETS[name], **overrides})


LOSS_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # A = (R − mean)/(std + ε); token-ratio PPO clip ε = 0.2; per-sequence mean then mean; optional k3 KL.
        "grpo": MappingProxyType(
            dict(objective="ppo", ratio_level="token", normalization="sequence", clip_eps_low=0.2, clip_eps_high=0.2,
                 advantage="group_std", kl_estimator="k3", kl_beta=0.0)
        ),
        # A = R − mean; Σ ℓ / (G × L_max) per group, i.e. Σ ℓ / (B × L_max); no KL. Needs max_response_tokens.
        "dr_grpo": MappingProxyType(
            dict(objective="ppo", ratio_level="token", normalization="constant", clip_eps_low=0.2, clip_eps_high=0.2,
                 advantage="group_mean", kl_beta=0.0)
        ),
        # Clip-higher 0.2/0.28, one token-level mean, dynamic sampling, truncated responses masked, no KL.
        "dapo": MappingProxyType(
            dict(objective="ppo", ratio_level="token", normalization="token", clip_eps_low=0.2, clip_eps_high=0.28,
                 advantage="group_std", drop_zero_variance_groups=True, overlong="mask", kl_beta=0.0)
        ),
        # Sequence ratio exp(mean_t log r), tight clip 3e-4/4e-4, mean over responses.
        "gspo": MappingProxyType(
            dict(objective="ppo", ratio_level="sequence", normalization="sequence", clip_eps_low=3e-4,
                 clip_eps_high=4e-4, advantage="group_std", kl_beta=0.0)
        ),
        # sg(clip(r, 0, 1.28)) · A · log π per token, token-level mean. No lower bound (MiniMax-M1 tunes only the
        # upper one); 0.28 is our default for it.
        "cispo": MappingProxyType(
            dict(objective="cispo", ratio_level="token", normalization="token", clip_eps_low=1.0, clip_eps_high=0.28,
                 advantage="group_std", kl_beta=0.0)
        ),
    }
)


# --------------------------------------------------------------------------------------------------
# The pieces


def _stop(x: NamedArray) -> NamedArray:
    return jax.lax.stop_gradient(x)


def _row_count(mask: NamedArray) -> NamedArray:
    """|o_i| = Σ_t m_{i,t}, shape [batch]."""
    return hax.sum(mask.astype(jnp.float32), axis=POS)


def masked_mean(x: NamedArray, mask: NamedArray) -> jax.Array:
    """Σ m·x / max(Σ m, 1) over every axis: a token-level mean that is 0 on an all-masked input."""
    m = mask.astype(bool)
    total = hax.sum(hax.where(m, x, 0.0)).array
    return total / jnp.maximum(hax.sum(m.astype(jnp.float32)).array, 1.0)


def importance_ratio(
    logprobs: NamedArray, anchor_logprobs: NamedArray, mask: NamedArray, level: RatioLevel = "token"
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
        seq_log_r = hax.sum(log_r, axis=POS) / hax.maximum(_row_count(m), 1.0)
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
        log_w = hax.broadcast_to(hax.sum(log_w, axis=POS), log_w.axes)
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


def aggregate(
    per_token: NamedArray, mask: NamedArray, normalization: Normalization, max_response_tokens: int | None = None
) -> jax.Array:
    """Reduces per-token terms x_{i,t} of shape [batch, position] to one scalar:

        token:     Σ_{i,t} m x / N                                   (N = trained tokens in the batch)
        sequence:  (1/B') Σ_{i: |o_i|>0} (Σ_t m x / |o_i|)           (B' = rows with a trained token)
        constant:  Σ_{i,t} m x / (B · L_max)                         (B = rows, padding included)

    `constant` is Dr. GRPO's (1/G)(1/L_max) per group averaged over groups: no response's weight depends on
    its own length or on how many tokens the batch holds. Masked positions never contribute, whatever
    their values (even inf or NaN).
    """
    m = mask.astype(bool)
    x = hax.where(m, per_token, 0.0)
    if normalization == "token":
        return masked_mean(per_token, m)
    if normalization == "sequence":
        counts = _row_count(m)
        rows = hax.sum(x, axis=POS) / hax.maximum(counts, 1.0)
        nonempty = hax.sum((counts > 0).astype(jnp.float32)).array
        return hax.sum(rows).array / jnp.maximum(nonempty, 1.0)
    if normalization == "constant":
        if max_response_tokens is None:
            raise ValueError("constant normalization needs max_response_tokens")
        rows = per_token.resolve_axis(BATCH).size
        return hax.sum(x).array / float(rows * max_response_tokens)
    raise ValueError(f"unknown normalization {normalization!r}")


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The configured loss from per-token logprobs of π_θ (all arrays [batch, position]).

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
    Token fractions and means are over trained tokens (loss_mask = 1).
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
    ratio = importance_ratio(lp, anchor, m, config.ratio_level)
    weight, affected = importance_weight(
        anchor,
        mu,
        m,
        correction=config.correction,
        level=config.correction_level,
        tis_cap=config.tis_cap,
        mis_low=config.mis_low,
        mis_high=config.mis_high,
    )

    eps_low, eps_high = config.clip_eps_low, config.clip_eps_high
    if config.objective == "ppo":
        objective = ppo_clip_objective(ratio, adv, eps_low, eps_high)
        clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
        clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    elif config.objective == "cispo":
        objective = cispo_objective(ratio, adv, lp, eps_low, eps_high)
        clipped_low = ratio < 1.0 - eps_low
        clipped_high = ratio > 1.0 + eps_high
    else:
        raise ValueError(f"unknown objective {config.objective!r}")
    per_token = -weight * objective
    policy_loss = aggregate(per_token, m, config.normalization, config.max_response_tokens)

    if config.uses_reference and reference_logprobs is None:
        raise ValueError(f"kl_beta={config.kl_beta} needs reference_logprobs (a frozen reference model's logprobs)")
    if reference_logprobs is not None:
        kl_tok = kl_estimate(lp, hax.where(m, reference_logprobs, 0.0), config.kl_estimator)
        kl = aggregate(kl_tok, m, config.normalization, config.max_response_tokens)
    else:
        kl = jnp.zeros((), jnp.float32)
    kl_loss = config.kl_beta * kl if config.uses_reference else jnp.zeros((), jnp.float32)
    loss = policy_loss + kl_loss

    num_tokens = hax.sum(m.astype(jnp.float32)).array
    r = _stop(ratio)
    has_tokens = num_tokens > 0
    log_mismatch = _stop(lp - mu)  # log π_θ − log μ on trained tokens
    affected_frac = masked_mean(affected.astype(jnp.float32), m)
    metrics = {
        "policy_loss": policy_loss,
        "kl_loss": kl_loss,
        "kl": kl,
        "clip_low_frac": masked_mean(clipped_low.astype(jnp.float32), m),
        "clip_high_frac": masked_mean(clipped_high.astype(jnp.float32), m),
        "ratio_mean": masked_mean(r, m),
        "ratio_min": jnp.where(has_tokens, hax.min(hax.where(m, r, jnp.inf)).array, 1.0),
        "ratio_max": jnp.where(has_tokens, hax.max(hax.where(m, r, -jnp.inf)).array, 1.0),
        "mismatch_abs_logprob_diff": masked_mean(hax.abs(log_mismatch), m),
        # k3 estimate of KL(μ ‖ π_θ) on tokens sampled from μ: E_μ[π_θ/μ − 1 − log(π_θ/μ)].
        "mismatch_kl": masked_mean(hax.exp(log_mismatch) - 1.0 - log_mismatch, m),
        "is_weight_mean": masked_mean(weight, m),
        "is_truncated_frac": affected_frac if config.correction == "tis" else jnp.zeros((), jnp.float32),
        "is_masked_frac": affected_frac if config.correction == "mis" else jnp.zeros((), jnp.float32),
        "num_tokens": num_tokens,
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# The policy forward


def _vocab_entropy(h: NamedArray, lm_head: NamedArray, Embed: hax.Axis, Vocab: hax.Axis, block_size: int) -> NamedArray:
    """H = log Z − Σ_v p_v ℓ_v per position, over vocabulary blocks with an online max (never [.., Vocab] at once
    when block_size < |Vocab|). For metrics: the caller passes detached inputs."""
    shape = hax.sum(h, axis=Embed).axes
    init = (hax.full(shape, -jnp.inf, jnp.float32), hax.zeros(shape, jnp.float32), hax.zeros(shape, jnp.float32))

    def step(start, carry, size):
        running_max, z, weighted = carry
        Block = Vocab.resize(size)
        logits = hax.dot(h, lm_head[Vocab, hax.dslice(start, Block)], axis=Embed).astype(jnp.float32)
        new_max = hax.maximum(running_max, hax.max(logits, axis=Block))
        scale = hax.exp(running_max - new_max)
        e = hax.exp(logits - new_max)
        return new_max, z * scale + hax.sum(e, axis=Block), weighted * scale + hax.sum(e * logits, axis=Block)

    full, rest = divmod(Vocab.size, block_size)
    carry = init
    if full == 1:
        carry = step(0, carry, block_size)
    elif full > 1:
        carry = jax.lax.fori_loop(0, full, lambda b, c: step(b * block_size, c, block_size), carry)
    if rest:
        carry = step(full * block_size, carry, rest)
    running_max, z, weighted = carry
    return running_max + hax.log(z) - weighted / z


def lm_head_weight(model: LmHeadModel) -> NamedArray:
    """The output projection, tied or not; with a LoRA adapter on the head (`marinrl/lora.py`) its merged
    weight W + scale·A·B (a vocab × embed × rank product: cheap, and differentiable in A and B)."""
    from levanter.lora import LoraLinear

    head = getattr(model, "lm_head", None)
    if isinstance(head, LoraLinear):
        weight = head.wrapped.weight
        return (weight + head.lora.merge().astype(weight.dtype)).rearrange(weight.axes)
    return model.get_lm_head()


def _policy_forward(
    model: LmHeadModel, batch: TrainingBatch, *, key, with_entropy: bool
) -> tuple[NamedArray, NamedArray | None, jax.Array | float]:
    """(log π(target_ids) at the batch temperature, entropy or None, auxiliary model loss)."""
    out = model.activations(batch.input_ids, AttentionMask.causal(), key=key)
    aux: jax.Array | float = 0.0
    if isinstance(out, tuple):  # mixture-of-experts models return (activations, load-balancing loss)
        out, aux = out
    # logits / T = (h / T) · W: scaling the activations keeps the lm head blockwise. A temperature of 0
    # (greedy) has no logprobs; such rows are scored at T = 1 and should not be trained on.
    temperature = hax.where(batch.temperature > 0, batch.temperature, 1.0)
    h = (out / temperature).astype(out.dtype)
    lm_head = lm_head_weight(model)
    Vocab = lm_head.resolve_axis(model.Vocab.name)
    block_size = min(model.config.cross_entropy_block_size or Vocab.size, Vocab.size)
    # Levanter's blockwise cross-entropy has a custom VJP that recomputes each logits block in the
    # backward pass, so neither pass holds [batch, position, vocab] beyond one block.
    nll = fused_cross_entropy_loss_and_logsumexp_penalty(
        h,
        lm_head,
        Contract=model.Embed,
        Label=Vocab,
        target_y=batch.target_ids,
        reduction=None,
        where=None,
        logsumexp_weight=0.0,
        block_size=block_size,
        dtype=jnp.float32,
    )
    entropy = _vocab_entropy(_stop(h), _stop(lm_head), model.Embed, Vocab, block_size) if with_entropy else None
    return -nll, entropy, aux


def token_logprobs(model: LmHeadModel, batch: TrainingBatch, *, key=None) -> NamedArray:
    """log π(target_ids[t] | input_ids[..t]) under `model`, shape [batch, position], float32.

        log π(o_t) = z_t[o_t] − log Σ_v exp z_t[v],     z_t = logits_t / T_row

    Logits are divided by each row's sampling temperature, so at the sampler's weights this equals the
    sampler's logprobs. Used for the policy (inside `rl_loss`), the frozen reference and π_old.
    Positions outside the loss mask hold whatever the model says; callers mask them.
    """
    return _policy_forward(model, batch, key=key, with_entropy=False)[0]


def rl_loss(
    model: LmHeadModel,
    batch: TrainingBatch,
    *,
    config: LossConfig,
    reference_logprobs: NamedArray | None = None,
    old_logprobs: NamedArray | None = None,
    key=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The configured GRPO-family loss of `model` on `batch`: `loss_from_logprobs` on `token_logprobs`.

    `reference_logprobs` (π_ref, required when kl_beta ≠ 0) and `old_logprobs` (π_old, optional under the
    recomputed anchor) are `token_logprobs` of those models on the same batch. Jittable; as a Levanter
    Trainer loss: `functools.partial(rl_loss, config=config)`. Metrics are those of `loss_from_logprobs`
    plus `entropy`, the mean entropy of π_θ (at the sampling temperature) on trained tokens.
    """
    logprobs, entropy, aux = _policy_forward(model, batch, key=key, with_entropy=True)
    loss, metrics = loss_from_logprobs(
        logprobs,
        sampler_logprobs=batch.sampler_logprobs,
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        config=config,
        old_logprobs=old_logprobs,
        reference_logprobs=reference_logprobs,
    )
    metrics["entropy"] = masked_mean(entropy, batch.loss_mask)
    return loss + aux, metrics


# --------------------------------------------------------------------------------------------------
# The run header


def _closest_preset(config: LossConfig) -> str:
    best = None
    for name in LOSS_PRESETS:
        base = {f.name: f.default for f in dataclasses.fields(LossConfig)} | dict(LOSS_PRESETS[name])
        diff = [f"{k}={getattr(config, k)!r}" for k in base if base[k] != getattr(config, k)]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    name, diff = best
    return name if not diff else f"{name} + {', '.join(diff)}"


def describe(config: LossConfig) -> str:
    """One line stating the objective, normalization, ratio anchor and correction, KL placement and the
    ingestion-time choices, in words. Every run prints it: results under one preset name are not
    comparable unless these match."""
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    ratio = "token ratio r" if config.ratio_level == "token" else "sequence ratio s_i = exp(mean_t log r) (GSPO)"
    if config.objective == "ppo":
        objective = f"PPO clip on the {ratio}, min(r·A, clip(r, {lo:g}, {hi:g})·A)"
    else:
        objective = f"CISPO on the {ratio}, sg(clip(r, {lo:g}, {hi:g}))·A·log π"
    normalization = {
        "token": "one token-level mean over the batch",
        "sequence": "mean over each response's tokens, then over responses",
        "constant": f"sum over tokens / (rows × {config.max_response_tokens}) constant",
    }[config.normalization]
    if config.ratio_anchor == "sampler":
        anchor = "anchor sampler (r = π_θ/μ from stored logprobs, no correction)"
    else:
        level = "per token" if config.correction_level == "token" else "per sequence"
        correction = {
            "none": "no importance weight",
            "tis": f"× detached TIS weight min(π_old/μ, {config.tis_cap:g}) {level}",
            "mis": f"× detached MIS weight π_old/μ kept in [{config.mis_low:g}, {config.mis_high:g}] {level}",
        }[config.correction]
        anchor = f"anchor recomputed (r = π_θ/π_old) {correction}"
    if config.uses_reference:
        kl = f"KL {config.kl_estimator}(π_θ‖π_ref) × β={config.kl_beta:g} in the loss, same normalization"
    else:
        kl = "no KL (no reference model)"
    ingest = [f"advantages {config.advantage}"]
    if config.drop_zero_variance_groups:
        ingest.append("zero-variance groups dropped")
    if config.overlong == "mask":
        ingest.append("truncated responses masked")
    elif config.overlong == "penalty":
        ingest.append(
            f"overlong penalty up to −{config.overlong_penalty:g} over the last {config.overlong_cache_tokens} "
            f"of {config.max_response_tokens} tokens"
        )
    return (
        f"loss [{_closest_preset(config)}]: {objective}; normalization: {normalization}; {anchor}; {kl}; "
        f"{', '.join(ingest)}"
    )
