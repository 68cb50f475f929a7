"""GRPO-family losses against a straightforward NumPy reference (values and gradients), their
invariants, and the policy forward through a tiny real Levanter Llama."""

from __future__ import annotations

import dataclasses
import functools

import draccus
import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from factories import HAND_ADVANTAGES

from marinrl.config.loss import LOSS_PRESETS, LossConfig
from marinrl.train.advantages import group_advantages, overlong_shaping
from marinrl.train.batching import TrainingBatch
from marinrl.train.losses import describe, loss_from_logprobs, rl_loss, token_logprobs

PRESETS = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
L_MAX = 12  # generation budget used by the constant normalization in these tests


def preset(name: str, **overrides) -> LossConfig:
    if name == "dr_grpo" or overrides.get("normalization") == "constant":
        overrides.setdefault("max_response_tokens", L_MAX)
    return LossConfig.preset(name, **overrides)


# --------------------------------------------------------------------------------------------------
# Hand-made groups: three groups of four responses (the third with equal rewards) and one padding row.
# (prompt length, response length, env-token positions inside the response masked out)
GROUPS = {
    "a": ([1.0, 0.0, 0.0, 1.0], [(2, 6, ()), (3, 3, ()), (2, 8, (3, 4)), (4, 5, ())]),
    "b": ([0.5, 0.0, 1.0, 0.25], [(1, 9, ()), (2, 2, ()), (3, 6, (1,)), (2, 1, ())]),
    "c": ([1.0, 1.0, 1.0, 1.0], [(2, 4, ()), (2, 7, ()), (5, 3, ()), (3, 5, ())]),
}
B, P = 13, 10
ZERO_VARIANCE_ROWS = slice(8, 12)
PAD_ROW = 12


def make_mask() -> np.ndarray:
    mask = np.zeros((B, P), bool)
    row = 0
    for _, specs in GROUPS.values():
        for prompt, response, env in specs:
            for j in range(response):
                if j not in env:
                    mask[row, prompt - 1 + j] = True
            row += 1
    return mask


def make_advantages(kind: str, mask: np.ndarray) -> np.ndarray:
    adv = np.zeros((B, P))
    row = 0
    for rewards, _specs in GROUPS.values():
        for a in group_advantages(np.array(rewards), kind):
            adv[row] = np.where(mask[row], a, 0.0)
            row += 1
    return adv.astype(np.float32)


MASK = make_mask()
_rng = np.random.default_rng(7)
MU = np.where(MASK, -_rng.uniform(0.05, 3.0, (B, P)), 0.0).astype(np.float32)
DELTA = _rng.normal(0.0, 0.35, (B, P))
OLD = (MU + np.where(MASK, _rng.normal(0.0, 0.6, (B, P)), 0.0)).astype(np.float32)
REF = (MU + _rng.normal(0.0, 0.4, (B, P))).astype(np.float32)


def policy_logprobs(scale: float, base: np.ndarray = MU) -> np.ndarray:
    """π_θ's logprobs: the base plus a perturbation; masked positions hold arbitrary model numbers."""
    return np.where(MASK, base + scale * DELTA, -1.7).astype(np.float32)


def delta_scale(name: str) -> float:
    return 2e-3 if name == "gspo" else 1.0  # GSPO's bounds are ±3e-4: stay near them so both sides occur


def named(x) -> hax.NamedArray:
    return hax.named(jnp.asarray(x, jnp.float32), ("batch", "position"))


@functools.partial(jax.jit, static_argnames=("config",))
def _jax_loss(lp, mu, adv, mask, old, ref, config):
    def f(x):
        return loss_from_logprobs(
            x, sampler_logprobs=mu, advantages=adv, loss_mask=mask, config=config, old_logprobs=old,
            reference_logprobs=ref,
        )

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(lp)
    return loss, metrics, grad


def jax_loss(config, lp, mu=MU, adv=None, mask=MASK, old=None, ref=None):
    adv = make_advantages(config.advantage, MASK) if adv is None else adv
    loss, metrics, grad = _jax_loss(
        named(lp), named(mu), named(adv), named(mask), None if old is None else named(old),
        None if ref is None else named(ref), config,
    )
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad.array)


# --------------------------------------------------------------------------------------------------
# The NumPy reference: loops over rows and tokens, the formulas of docs/training.md written out.


def np_loss(cfg: LossConfig, lp, mu, adv, mask, old=None, ref=None):
    """(loss, d loss / d log π_θ, metrics) in float64."""
    lp, mu, adv = (np.asarray(x, np.float64) for x in (lp, mu, adv))
    mask = np.asarray(mask, bool)
    rows, _ = lp.shape
    if cfg.ratio_anchor == "sampler":
        anchor = mu
    else:
        anchor = lp.copy() if old is None else np.asarray(old, np.float64)  # detached either way
    n_row = mask.sum(1)
    n_tok = n_row.sum()
    coef = np.zeros_like(lp)  # ∂ aggregate / ∂ per-token term
    for i in range(rows):
        for t in np.flatnonzero(mask[i]):
            if cfg.normalization == "token":
                coef[i, t] = 1.0 / n_tok
            elif cfg.normalization == "sequence":
                coef[i, t] = 1.0 / (n_row[i] * (n_row > 0).sum())
            else:
                coef[i, t] = 1.0 / (rows * cfg.max_response_tokens)
    ratio, d_ratio = np.ones_like(lp), np.zeros_like(lp)
    weight, affected = np.ones_like(lp), np.zeros(lp.shape, bool)
    for i in range(rows):
        idx = np.flatnonzero(mask[i])
        if idx.size == 0:
            continue
        log_r = lp[i, idx] - anchor[i, idx]
        if cfg.ratio_level == "token":
            ratio[i, idx] = np.exp(log_r)
        else:
            ratio[i, idx] = np.exp(log_r.mean())
        d_ratio[i, idx] = ratio[i, idx]  # token: ∂e^{log r}; sequence (GSPO-token): sg(s_i)·∂(π/sg π)
        if cfg.ratio_anchor == "recomputed" and cfg.correction != "none":
            log_w = anchor[i, idx] - mu[i, idx]
            if cfg.correction_level == "sequence":
                log_w = np.full(idx.size, log_w.sum())
            w = np.exp(log_w)
            if cfg.correction == "tis":
                affected[i, idx] = w > cfg.tis_cap
                w = np.minimum(w, cfg.tis_cap)
            else:
                keep = (w >= cfg.mis_low) & (w <= cfg.mis_high)
                affected[i, idx] = ~keep
                w = np.where(keep, w, 0.0)
            weight[i, idx] = w
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    loss, grad = 0.0, np.zeros_like(lp)
    clip_low = clip_high = 0
    for i, t in zip(*np.nonzero(mask)):
        r, a, w = ratio[i, t], adv[i, t], weight[i, t]
        if cfg.objective == "ppo":
            objective = min(r * a, min(max(r, lo), hi) * a)
            low, high = r < lo and a < 0, r > hi and a > 0
            d_objective = 0.0 if (low or high) else a * d_ratio[i, t]
        else:
            objective = min(max(r, lo), hi) * a * lp[i, t]
            low, high = r < lo, r > hi
            d_objective = min(max(r, lo), hi) * a
        clip_low += low
        clip_high += high
        loss += coef[i, t] * -w * objective
        grad[i, t] += coef[i, t] * -w * d_objective
    policy_loss, kl = loss, 0.0
    if ref is not None:
        delta = np.asarray(ref, np.float64) - lp
        k, dk = {
            "k1": (-delta, np.ones_like(delta)),
            "k2": (0.5 * delta**2, -delta),
            "k3": (np.exp(delta) - delta - 1.0, 1.0 - np.exp(delta)),
        }[cfg.kl_estimator]
        kl = float((coef * np.where(mask, k, 0.0)).sum())
        loss += cfg.kl_beta * kl
        grad += cfg.kl_beta * coef * np.where(mask, dk, 0.0)
    trainer = anchor if cfg.ratio_anchor == "recomputed" else lp  # π_old, or π_θ at the start of the step
    x = (trainer - mu)[mask]
    log_w = x if cfg.correction_level == "token" else np.concatenate(
        [np.full(mask[i].sum(), (trainer - mu)[i, mask[i]].sum()) for i in range(rows)])
    metrics = {
        "policy_loss": policy_loss,
        "kl": kl,
        "kl_loss": cfg.kl_beta * kl,
        "clip_low_frac": clip_low / n_tok,
        "clip_high_frac": clip_high / n_tok,
        "ratio_min": ratio[mask].min(),
        "ratio_mean": ratio[mask].mean(),
        "ratio_max": ratio[mask].max(),
        "mismatch/abs_logprob_mean": np.abs(x).mean(),
        "mismatch/abs_logprob_max": np.abs(x).max(),
        "mismatch/k3_kl": (np.exp(x) - 1.0 - x).mean(),
        "mismatch/tis_clipped_frac": (np.exp(log_w) > cfg.tis_cap).mean(),
        "mismatch/mis_masked_frac": ((np.exp(log_w) < cfg.mis_low) | (np.exp(log_w) > cfg.mis_high)).mean(),
        "is_weight_mean": weight[mask].mean(),
        "is_truncated_frac": affected[mask].mean() if cfg.correction == "tis" else 0.0,
        "is_masked_frac": affected[mask].mean() if cfg.correction == "mis" else 0.0,
        "num_tokens": float(n_tok),
    }
    return loss, grad, metrics


def assert_matches(cfg, lp, *, old=None, ref=None, adv=None):
    adv = make_advantages(cfg.advantage, MASK) if adv is None else adv
    loss, metrics, grad = jax_loss(cfg, lp, adv=adv, old=old, ref=ref)
    want_loss, want_grad, want_metrics = np_loss(cfg, lp, MU, adv, MASK, old=old, ref=ref)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-4, atol=2e-7)
    for key, want in want_metrics.items():
        np.testing.assert_allclose(metrics[key], want, rtol=2e-5, atol=1e-6, err_msg=key)
    return grad, want_metrics


# --------------------------------------------------------------------------------------------------
# Presets against the reference


@pytest.mark.parametrize("name", PRESETS)
def test_preset_matches_numpy_reference(name):
    cfg = preset(name)
    _, metrics = assert_matches(cfg, policy_logprobs(delta_scale(name)))
    # The data exercises both sides of the clip, so the comparison covers both branches.
    assert metrics["clip_low_frac"] + metrics["clip_high_frac"] > 0
    assert metrics["clip_low_frac"] + metrics["clip_high_frac"] < 0.9


def test_presets_are_what_design_says():
    grpo, dr, dapo = preset("grpo"), preset("dr_grpo"), preset("dapo")
    gspo, cispo = preset("gspo"), preset("cispo")
    assert (grpo.advantage, grpo.normalization, grpo.clip_eps_low, grpo.clip_eps_high, grpo.kl_estimator) == (
        "group_std", "sequence", 0.2, 0.2, "k3")
    assert (dr.advantage, dr.normalization, dr.kl_beta) == ("group_mean", "constant", 0.0)
    assert (dapo.normalization, dapo.clip_eps_low, dapo.clip_eps_high) == ("token", 0.2, 0.28)
    assert dapo.drop_zero_variance_groups and dapo.overlong == "mask" and dapo.kl_beta == 0.0
    assert (gspo.ratio_level, gspo.normalization, gspo.clip_eps_low, gspo.clip_eps_high) == (
        "sequence", "sequence", 3e-4, 4e-4)
    assert (cispo.objective, cispo.normalization) == ("cispo", "token")
    assert LossConfig() == grpo  # the defaults are GRPO
    assert not any(LossConfig.preset(n, max_response_tokens=8).uses_reference for n in PRESETS)


def test_gspo_equals_the_sequence_level_objective_of_the_paper():
    """With one advantage per response, GSPO-token gives GSPO's value and gradient:
    J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log π_θ/μ) — checked by finite differences."""
    cfg = preset("gspo")
    adv = make_advantages(cfg.advantage, MASK)
    lp = policy_logprobs(delta_scale("gspo")).astype(np.float64)
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high

    def paper(x):
        terms = []
        for i in range(B):
            idx = np.flatnonzero(MASK[i])
            if idx.size:
                s, a = np.exp((x[i, idx] - MU[i, idx]).mean()), adv[i, idx[0]]
                terms.append(min(s * a, np.clip(s, lo, hi) * a))
        return -np.mean(terms)

    loss, _, grad = jax_loss(cfg, lp, adv=adv)
    np.testing.assert_allclose(loss, paper(lp), rtol=1e-5, atol=1e-7)
    eps = 1e-7
    for i, t in zip(*np.nonzero(MASK)):
        bump = np.zeros_like(lp)
        bump[i, t] = eps
        fd = (paper(lp + bump) - paper(lp - bump)) / (2 * eps)
        np.testing.assert_allclose(grad[i, t], fd, rtol=1e-3, atol=1e-6)


def test_reference_gradient_matches_its_own_finite_differences():
    """The reference's analytic gradient agrees with finite differences of its own value for the
    presets without stop-gradients (so the reference is not wrong in the same way as the code)."""
    for name in ("grpo", "dr_grpo", "dapo"):
        cfg = preset(name)
        adv = make_advantages(cfg.advantage, MASK)
        lp = policy_logprobs(1.0).astype(np.float64)
        _, grad, _ = np_loss(cfg, lp, MU, adv, MASK)
        for i, t in list(zip(*np.nonzero(MASK)))[::3]:
            bump = np.zeros_like(lp)
            bump[i, t] = 1e-6
            fd = (np_loss(cfg, lp + bump, MU, adv, MASK)[0] - np_loss(cfg, lp - bump, MU, adv, MASK)[0]) / 2e-6
            np.testing.assert_allclose(grad[i, t], fd, rtol=1e-5, atol=1e-9)


# --------------------------------------------------------------------------------------------------
# Invariants


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo"])
def test_ppo_clip_zeroes_gradient_exactly_where_it_engages(name):
    cfg = preset(name)
    lp = policy_logprobs(delta_scale(name))
    adv = make_advantages(cfg.advantage, MASK)
    _, _, grad = jax_loss(cfg, lp)
    ratio = np.exp(lp - MU)
    if cfg.ratio_level == "sequence":
        for i in range(B):
            idx = np.flatnonzero(MASK[i])
            if idx.size:
                ratio[i, idx] = np.exp((lp[i, idx] - MU[i, idx]).mean())
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    clipped = MASK & (((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0)))
    free = MASK & (adv != 0) & ~clipped
    outside_but_free = free & ((ratio > hi) | (ratio < lo))  # wrong-sign side: PPO keeps these
    assert clipped.sum() >= 3 and free.sum() >= 3 and outside_but_free.sum() >= 1
    assert np.all(grad[clipped] == 0.0)
    assert np.all(grad[free] != 0.0)


def test_cispo_never_drops_a_token_gradient():
    cfg = preset("cispo")
    lp = policy_logprobs(1.0)
    adv = make_advantages(cfg.advantage, MASK)
    _, metrics, grad = jax_loss(cfg, lp)
    ratio = np.exp(lp - MU)
    trained = MASK & (adv != 0)
    assert metrics["clip_high_frac"] > 0 and np.any(trained & (ratio > 1 + cfg.clip_eps_high))
    assert np.all(grad[trained] != 0.0)
    # The weight is bounded: ∂L/∂log π = −clip(r)·A/N, never more than (1+ε_high)·|A|/N.
    n = MASK.sum()
    assert np.all(np.abs(grad[trained]) <= (1 + cfg.clip_eps_high) * np.abs(adv[trained]) / n * (1 + 1e-5))


@pytest.mark.parametrize("name", PRESETS)
def test_zero_variance_group_contributes_nothing(name):
    cfg = preset(name)
    lp = policy_logprobs(delta_scale(name))
    loss, _, grad = jax_loss(cfg, lp)
    assert np.all(grad[ZERO_VARIANCE_ROWS] == 0.0)
    moved = lp.copy()
    moved[ZERO_VARIANCE_ROWS] += np.where(MASK[ZERO_VARIANCE_ROWS], 0.7, 0.0).astype(np.float32)
    loss2, _, grad2 = jax_loss(cfg, moved)
    assert loss2 == pytest.approx(loss, rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(grad2, grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "name, with_old_and_ref", [(n, False) for n in PRESETS] + [("grpo", True)]
)
def test_masked_positions_contribute_nothing(name, with_old_and_ref):
    """Garbage (NaN, inf, huge numbers) outside the loss mask changes neither value nor gradient."""
    if with_old_and_ref:
        cfg = preset(name, kl_beta=0.1, ratio_anchor="recomputed", correction="tis")
        old, ref = OLD, REF
    else:
        cfg, old, ref = preset(name), None, None
    lp = policy_logprobs(delta_scale(name))
    adv = make_advantages(cfg.advantage, MASK)
    loss, metrics, grad = jax_loss(cfg, lp, adv=adv, old=old, ref=ref)
    junk = np.where(np.random.default_rng(1).random((B, P)) < 0.5, np.nan, 1e30).astype(np.float32)
    dirty = [None if x is None else np.where(MASK, x, junk).astype(np.float32) for x in (lp, MU, adv, old, ref)]
    d_loss, d_metrics, d_grad = jax_loss(cfg, dirty[0], mu=dirty[1], adv=dirty[2], old=dirty[3], ref=dirty[4])
    assert d_loss == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(d_grad, grad, rtol=1e-6, atol=1e-9)
    assert np.all(d_grad[~MASK] == 0.0)
    for key, value in d_metrics.items():
        assert value == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


def test_constant_normalization_does_not_depend_on_response_length():
    """At r = 1 each trained token's gradient is −A / (B·L_max) under dr_grpo, whatever its row's length or the
    batch's token count; per-sequence (grpo) and token-level (dapo) means do depend on them."""
    adv = make_advantages("group_mean", MASK)
    lp = MU.copy()
    _, _, grad = jax_loss(preset("dr_grpo"), lp, adv=adv)
    np.testing.assert_allclose(grad[MASK], -adv[MASK] / (B * L_MAX), rtol=1e-6)
    # Trim the responses of group b (rows 4-7). A token's weight should not move with its own row's length
    # (only dr_grpo: grpo weighs 1/|o_i|, dapo 1/N) nor with other rows' lengths (dr_grpo and grpo; dapo's N moves).
    short = MASK.copy()
    short[4:8, 5:] = False
    kept = short[4:8]
    for name, own_invariant, others_invariant in (("dr_grpo", True, True), ("grpo", False, True),
                                                  ("dapo", False, False)):
        cfg = preset(name)  # advantages are passed in: the config's advantage kind plays no part here
        _, _, g_full = jax_loss(cfg, lp, adv=adv)
        _, _, g_short = jax_loss(cfg, lp, adv=adv, mask=short)
        own = np.allclose(g_full[4:8][kept], g_short[4:8][kept], rtol=1e-6, atol=0)
        others = np.allclose(g_full[0:4][MASK[0:4]], g_short[0:4][MASK[0:4]], rtol=1e-6, atol=0)
        assert (own, others) == (own_invariant, others_invariant), name


# --------------------------------------------------------------------------------------------------
# Off-policy correction and KL


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_correction_matches_numpy(correction, level):
    cfg = preset("dapo", ratio_anchor="recomputed", correction=correction, correction_level=level,
                 mis_low=0.5, mis_high=2.0, tis_cap=2.0)
    lp = policy_logprobs(0.3, base=OLD)
    grad, metrics = assert_matches(cfg, lp, old=OLD)
    frac = metrics["is_truncated_frac" if correction == "tis" else "is_masked_frac"]
    assert 0 < frac < 1  # the weights straddle the bound(s)
    if correction == "mis":
        w = np.exp(OLD - MU)
        if level == "sequence":
            w = np.exp(np.where(MASK, OLD - MU, 0).sum(1, keepdims=True)) * np.ones((1, P))
        rejected = MASK & ((w < 0.5) | (w > 2.0))
        assert rejected.any() and np.all(grad[rejected] == 0.0)


def test_recomputed_anchor_without_old_logprobs_is_the_detached_policy():
    """old_logprobs=None means π_old = sg(π_θ): identical to passing π_θ's own logprobs as π_old, ratio 1,
    and the TIS weight min(π_θ/μ, C) carrying the correction."""
    cfg = preset("grpo", ratio_anchor="recomputed", correction="tis")
    lp = policy_logprobs(1.0)
    loss, metrics, grad = jax_loss(cfg, lp)
    loss2, _, grad2 = jax_loss(cfg, lp, old=lp)
    assert loss == pytest.approx(loss2, rel=1e-6)
    np.testing.assert_allclose(grad, grad2, rtol=1e-6)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0 and metrics["clip_low_frac"] == 0.0
    assert_matches(cfg, lp)
    assert metrics["is_truncated_frac"] > 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_numpy(estimator):
    cfg = preset("grpo", kl_beta=0.3, kl_estimator=estimator)
    _, metrics = assert_matches(cfg, policy_logprobs(1.0), ref=REF)
    x = np.where(MASK, REF - policy_logprobs(1.0), 0.0).astype(np.float64)
    if estimator == "k3":
        assert metrics["kl"] > 0 and np.all(np.exp(x) - x - 1 >= 0)


def test_kl_needs_reference_only_when_beta_is_nonzero():
    assert not preset("grpo").uses_reference and preset("grpo", kl_beta=0.04).uses_reference
    with pytest.raises(ValueError, match="reference_logprobs"):
        loss_from_logprobs(named(MU), sampler_logprobs=named(MU), advantages=named(MU), loss_mask=named(MASK),
                           config=preset("grpo", kl_beta=0.04))
    # With β = 0 a given reference is still measured, but not trained on.
    cfg = preset("grpo")
    loss, metrics, grad = jax_loss(cfg, policy_logprobs(1.0), ref=REF)
    loss0, _, grad0 = jax_loss(cfg, policy_logprobs(1.0))
    assert metrics["kl"] > 0 and metrics["kl_loss"] == 0 and loss == loss0
    np.testing.assert_array_equal(grad, grad0)


# --------------------------------------------------------------------------------------------------
# Configuration, header, shaping


def test_metric_names_reduce_correctly_across_microbatches():
    """Levanter reduces loss metrics over microbatches by name: min/max/sum where that is the meaning."""
    from levanter.metrics import ReductionType, auto_metric_from_name

    _, metrics, _ = jax_loss(preset("grpo"), policy_logprobs(1.0))
    special = {"ratio_min": ReductionType.MIN, "ratio_max": ReductionType.MAX, "num_tokens": ReductionType.SUM,
               "mismatch/abs_logprob_max": ReductionType.MAX}
    for key in [*metrics, "entropy"]:
        assert auto_metric_from_name(key, 1.0).reduction == special.get(key, ReductionType.MEAN), key


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_response_tokens"):
        LossConfig.preset("dr_grpo")
    with pytest.raises(ValueError, match="ratio_anchor='recomputed'"):
        LossConfig(correction="tis")
    with pytest.raises(ValueError, match="normalization"):
        LossConfig(normalization="mean")
    with pytest.raises(ValueError, match="unknown loss preset"):
        LossConfig.preset("ppo2")
    with pytest.raises(ValueError, match="no field"):
        LossConfig.preset("grpo", clip=0.3)
    with pytest.raises(ValueError, match="overlong_cache_tokens"):
        LossConfig.preset("dapo", overlong="penalty", max_response_tokens=100)
    with pytest.raises(ValueError, match="mis_low"):
        LossConfig(ratio_anchor="recomputed", correction="mis", mis_low=2.0, mis_high=1.0)


def test_config_round_trips_through_draccus():
    cfg = LossConfig.preset("dapo", overlong="penalty", max_response_tokens=64, overlong_cache_tokens=16,
                            ratio_anchor="recomputed", correction="mis", correction_level="sequence")
    assert draccus.decode(LossConfig, draccus.encode(cfg)) == cfg
    assert set(LOSS_PRESETS) == set(PRESETS)


def test_describe_states_normalization_anchor_correction_and_kl():
    lines = {name: describe(preset(name)) for name in PRESETS}
    assert len(set(lines.values())) == len(PRESETS) and all("\n" not in s for s in lines.values())
    assert lines["dapo"].startswith("loss [dapo]") and "token-level mean" in lines["dapo"]
    assert "then over responses" in lines["grpo"] and "no KL" in lines["grpo"]
    assert f"rows × {L_MAX}" in lines["dr_grpo"]
    assert "GSPO" in lines["gspo"] and "CISPO" in lines["cispo"]
    assert "anchor sampler" in lines["grpo"]
    line = describe(preset("grpo", ratio_anchor="recomputed", correction="mis", correction_level="sequence",
                           kl_beta=0.04))
    assert "anchor recomputed" in line and "MIS" in line and "per sequence" in line
    assert "k3" in line and "β=0.04" in line and "kl_beta=0.04" in line


def test_overlong_shaping():
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5])
    lengths = np.array([10, 80, 90, 100, 100])
    truncated = np.array([False, False, False, False, True])
    shaped, keep = overlong_shaping(rewards, lengths, truncated, mode="penalty", max_response_tokens=100,
                                    cache_tokens=20, penalty=1.0)
    np.testing.assert_allclose(shaped, [1.0, 1.0, -0.5, 0.0, -0.5])
    assert keep.all()
    shaped, keep = overlong_shaping(rewards, lengths, truncated, mode="mask")
    np.testing.assert_array_equal(shaped, rewards)
    np.testing.assert_array_equal(keep, ~truncated)
    shaped, keep = overlong_shaping(rewards, lengths, truncated, mode="none")
    np.testing.assert_array_equal(shaped, rewards)
    assert keep.all()
    with pytest.raises(ValueError, match="cache_tokens"):
        overlong_shaping(rewards, lengths, truncated, mode="penalty", max_response_tokens=100, cache_tokens=0)
    # The shaped group still has zero-sum advantages.
    assert abs(group_advantages(shaped, "group_std").sum()) < 1e-9


@pytest.mark.parametrize("kind", sorted(HAND_ADVANTAGES))
def test_group_advantages_equal_hand_computed_values(kind):
    """Literal references worked out by hand in factories.HAND_ADVANTAGES (e.g. RLOO's G/(G−1) factor)."""
    for rewards, want in HAND_ADVANTAGES[kind].items():
        got = group_advantages(np.array(rewards, dtype=np.float64), kind)
        # float64 arithmetic on numbers of order 1: the literals' own rounding (1e-9) dominates.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9, err_msg=f"{kind} {rewards}")


# --------------------------------------------------------------------------------------------------
# Through a tiny real Levanter Llama

VOCAB, LB, LP = 64, 4, 12
TEMPERATURES = np.array([1.0, 0.7, 1.3, 1.0], np.float32)


@eqx.filter_jit
def _init_llama(key):
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

    config = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, initializer_range=0.3)
    return LlamaLMHeadModel.init(hax.Axis("vocab", VOCAB), config, key=key)


def with_block_size(model, block_size: int):
    """The same weights with a blockwise lm-head cross-entropy (`cross_entropy_block_size`)."""
    config = dataclasses.replace(model.config, cross_entropy_block_size=block_size)
    return dataclasses.replace(model, transformer=dataclasses.replace(model.transformer, config=config))


@eqx.filter_jit
def _manual_logprobs(model, batch):
    """Reference forward: full logits, divide by temperature, log_softmax over vocab, take the target."""
    from levanter.layers.attention import AttentionMask

    logits = model(batch.input_ids, AttentionMask.causal()).rearrange(("batch", "position", "vocab")).array
    logits = logits / batch.temperature.array[:, :, None]
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, batch.target_ids.array[..., None], axis=-1)[..., 0]
    entropy = -(jnp.exp(logp) * logp).sum(-1)
    return hax.named(target, ("batch", "position")), hax.named(entropy, ("batch", "position"))


@pytest.fixture(scope="module")
def llama():
    full = _init_llama(jax.random.PRNGKey(0))
    blocked = with_block_size(full, 24)  # 64 = 2 blocks of 24 + a straggler of 16
    assert blocked.config.cross_entropy_block_size == 24
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (LB, LP + 1)).astype(np.int32)
    mask = np.zeros((LB, LP), np.float32)
    for row, (start, stop) in enumerate([(2, 12), (4, 9), (1, 6), (3, 12)]):
        mask[row, start:stop] = 1.0
    two_d = ("batch", "position")
    probe = TrainingBatch.one_sequence_per_row(
        input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask, sampler_logprobs=np.zeros((LB, LP)),
        advantages=mask * rng.normal(size=(LB, 1)).astype(np.float32), temperature=TEMPERATURES)
    manual, entropy = _manual_logprobs(full, probe)
    noise = rng.normal(0.0, 0.3, (LB, LP)).astype(np.float32)
    sampler = np.where(mask > 0, np.asarray(manual.array) + noise, 0.0).astype(np.float32)
    batch = dataclasses.replace(probe, sampler_logprobs=hax.named(jnp.asarray(sampler), two_d))
    return full, blocked, batch, manual, entropy


_token_logprobs = eqx.filter_jit(token_logprobs)
LLAMA_CFG = LossConfig.preset("grpo", kl_beta=0.05, ratio_anchor="recomputed", correction="tis")
_rl_loss = eqx.filter_jit(functools.partial(rl_loss, config=LLAMA_CFG))


@eqx.filter_jit
def _rl_loss_and_grad(model, batch, reference):
    loss_fn = functools.partial(rl_loss, config=LLAMA_CFG, reference_logprobs=reference)
    return eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, batch)


@eqx.filter_jit
def _manual_loss_and_grad(model, batch, reference):
    def f(m):
        logprobs, _ = _manual_logprobs(m, batch)
        return loss_from_logprobs(logprobs, sampler_logprobs=batch.sampler_logprobs, advantages=batch.advantages,
                                  loss_mask=batch.loss_mask, config=LLAMA_CFG, reference_logprobs=reference)

    return eqx.filter_value_and_grad(f, has_aux=True)(model)


def test_token_logprobs_equal_manual_forward_at_each_rows_temperature(llama):
    full, blocked, batch, manual, _ = llama
    want = np.asarray(manual.array)
    assert want.std() > 0.3  # not a uniform distribution: the comparison means something
    # 64 = 40 + a straggler of 24 is the shape Levanter's blockwise loss gets wrong (`lm_head_block`)
    for model in (full, blocked, with_block_size(full, 40)):
        got = _token_logprobs(model, batch)
        assert got.axes == batch.target_ids.axes
        np.testing.assert_allclose(np.asarray(got.array), want, atol=2e-5, rtol=1e-5)
    # Temperature matters: the same row at T = 1 gives different numbers.
    at_one = dataclasses.replace(batch, temperature=hax.named(jnp.ones((LB, LP)), ("batch", "position")))
    assert not np.allclose(np.asarray(_token_logprobs(full, at_one).array)[1], want[1], atol=1e-3)


def test_rl_loss_through_llama_is_finite_with_gradient_equal_to_plain_autodiff(llama):
    full, blocked, batch, manual, entropy = llama
    reference = hax.named(manual.array + 0.2, ("batch", "position"))
    (loss, metrics), grads = _rl_loss_and_grad(full, batch, reference)
    (want_loss, want_metrics), want_grads = _manual_loss_and_grad(full, batch, reference)
    assert np.isfinite(float(loss)) and float(loss) == pytest.approx(float(want_loss), rel=1e-4, abs=1e-6)
    for key, value in want_metrics.items():
        assert float(metrics[key]) == pytest.approx(float(value), rel=1e-4, abs=1e-6), key
    mask = np.asarray(batch.loss_mask.array) > 0
    assert float(metrics["entropy"]) == pytest.approx(float(np.asarray(entropy.array)[mask].mean()), rel=1e-5)
    leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))
    want_leaves = jax.tree_util.tree_leaves(eqx.filter(want_grads, eqx.is_inexact_array))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
    for g, w in zip(leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=1e-6)
    # The blockwise lm head (two blocks and a straggler; one block and a straggler) gives the same loss and
    # entropy
    for block_size in (24, 40):
        (b_loss, b_metrics), b_grads = _rl_loss_and_grad(with_block_size(full, block_size), batch, reference)
        assert float(b_loss) == pytest.approx(float(loss), rel=1e-5, abs=1e-6), block_size
        assert float(b_metrics["entropy"]) == pytest.approx(float(metrics["entropy"]), rel=1e-5), block_size
        # and the same gradients, to float32 rounding of sums over the vocabulary in another order
        for g, w in zip(jax.tree_util.tree_leaves(eqx.filter(b_grads, eqx.is_inexact_array)), leaves):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_a_large_vocabulary_is_computed_in_blocks_by_default():
    from marinrl.train.policy_forward import VOCAB_BLOCK, lm_head_block

    assert lm_head_block(None, 151_936) == VOCAB_BLOCK < 151_936  # Qwen3: no [tokens, vocab] float32 array
    assert lm_head_block(None, 512) == 512  # a small vocabulary stays one block
    assert lm_head_block(24, 64) == 24  # the model config's own block wins
    # one block and a straggler, which Levanter's blockwise loss counts twice: two halves instead
    assert lm_head_block(None, 49_152) == 24_576  # SmolLM2
    assert lm_head_block(40, 64) == 32
    assert lm_head_block(40, 81) == 40  # two blocks and a straggler are computed right


def test_token_logprobs_equal_log_softmax_at_smollm2s_vocabulary():
    """49,152 columns with the default block: every target's logprob is that of a plain log-softmax (a
    straggler counted twice made targets past column 32,768 positive, up to +27 nats)."""
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

    vocab = 49_152
    config = LlamaConfig(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, initializer_range=0.5)
    model = eqx.filter_jit(lambda k: LlamaLMHeadModel.init(hax.Axis("vocab", vocab), config, key=k))(
        jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (2, 13)).astype(np.int32)
    ids[:, 1::2] = rng.integers(40_000, vocab, (2, 6))  # targets in the last block
    batch = TrainingBatch.one_sequence_per_row(
        input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=np.ones((2, 12), np.float32),
        sampler_logprobs=np.zeros((2, 12)), advantages=np.zeros((2, 12), np.float32),
        temperature=np.ones(2, np.float32))
    want, _ = _manual_logprobs(model, batch)
    got = np.asarray(_token_logprobs(model, batch).array)
    assert (got < 0).all()
    np.testing.assert_allclose(got, np.asarray(want.array), atol=5e-5, rtol=1e-5)


def test_every_advantage_kind_has_one_estimator_and_a_hand_reference():
    """The registry, the config's choices and the hand references name the same estimators: adding one
    to any of them alone fails here (train/advantages.py says how to add one)."""
    from typing import get_args

    from marinrl.config.loss import AdvantageKind
    from marinrl.train.advantages import ADVANTAGE_ESTIMATORS

    assert set(get_args(AdvantageKind)) == set(ADVANTAGE_ESTIMATORS) == set(HAND_ADVANTAGES)
    with pytest.raises(ValueError, match="unknown advantage kind 'median'; expected one of group_std"):
        group_advantages(np.array([0.0, 1.0]), "median")


def test_every_objective_is_registered_and_stated_in_the_run_header():
    from typing import get_args

    from marinrl.config.loss import OBJECTIVE_WORDS, LossConfig, Objective, describe
    from marinrl.train.losses import OBJECTIVES

    assert set(get_args(Objective)) == set(OBJECTIVES) == set(OBJECTIVE_WORDS)
    for name in OBJECTIVES:
        header = describe(LossConfig(objective=name, clip_eps_low=0.2, clip_eps_high=0.28))
        assert OBJECTIVE_WORDS[name].split(" on the")[0] in header and "clip(r, 0.8, 1.28)" in header
