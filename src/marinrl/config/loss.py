"""`LossConfig`: the GRPO-family objective's configuration, its named presets, and `describe`, the one-line
header every run prints. The loss itself is in losses.py (formulas and notation there)."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Literal, Mapping, get_args

AdvantageKind = Literal["group_std", "group_mean", "rloo"]
"""The group advantage estimators of `train/advantages.ADVANTAGE_ESTIMATORS` (its docstring says how to add one)."""
OverlongMode = Literal["none", "mask", "penalty"]
"""DAPO's overlong shaping modes (`train/advantages.overlong_shaping`)."""
Objective = Literal["ppo", "cispo"]
"""The per-token objectives of `train/losses.OBJECTIVES` (its docstring says how to add one)."""
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
    def preset(cls, name: str, **overrides: Any) -> LossConfig:
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


def _closest_preset(config: LossConfig) -> str:
    best = None
    for name in LOSS_PRESETS:
        base = {f.name: f.default for f in dataclasses.fields(LossConfig)} | dict(LOSS_PRESETS[name])
        diff = [f"{k}={getattr(config, k)!r}" for k in base if base[k] != getattr(config, k)]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    name, diff = best
    return name if not diff else f"{name} + {', '.join(diff)}"


OBJECTIVE_WORDS: Mapping[str, str] = MappingProxyType({
    "ppo": "PPO clip on the {ratio}, min(r·A, clip(r, {lo:g}, {hi:g})·A)",
    "cispo": "CISPO on the {ratio}, sg(clip(r, {lo:g}, {hi:g}))·A·log π",
})
"""Each objective in words for the run header (`{ratio}`, `{lo}`, `{hi}`: the ratio and the clip bounds)."""


def describe(config: LossConfig) -> str:
    """One line stating the objective, normalization, ratio anchor and correction, KL placement and the
    ingestion-time choices, in words. Every run prints it: results under one preset name are not
    comparable unless these match."""
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    ratio = "token ratio r" if config.ratio_level == "token" else "sequence ratio s_i = exp(mean_t log r) (GSPO)"
    objective = OBJECTIVE_WORDS[config.objective].format(ratio=ratio, lo=lo, hi=hi)
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
