"""The sampler/trainer mismatch metrics (train/mismatch.py) against a NumPy reference of their formulas."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marinrl.train.mismatch import NAMES, PREFIX, k3, mismatch_metrics

ROWS, POS = 4, 9
CAPS = dict(tis_cap=1.5, mis_low=0.7, mis_high=1.4)


def named(x):
    return hax.named(jnp.asarray(x), ("batch", "position"))


def np_reference(trainer, sampler, mask, tis_cap, mis_low, mis_high, log_w=None):
    """The docstring's formulas, in float64 over the trained tokens."""
    d = (np.asarray(trainer, np.float64) - sampler)[mask]
    log_w = d if log_w is None else np.asarray(log_w, np.float64)[mask]
    w = np.exp(log_w)
    return {"abs_logprob_mean": np.abs(d).mean(), "abs_logprob_max": np.abs(d).max(),
            "k3_kl": (np.exp(d) - d - 1).mean(), "tis_clipped_frac": (w > tis_cap).mean(),
            "mis_masked_frac": ((w < mis_low) | (w > mis_high)).mean()}


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    sampler = -rng.uniform(0.1, 6.0, (ROWS, POS)).astype(np.float32)
    trainer = (sampler + rng.normal(0, 0.4, (ROWS, POS))).astype(np.float32)  # some tokens past every bound
    mask = rng.random((ROWS, POS)) < 0.7
    mask[-1] = False  # a row with nothing to train
    trainer[~mask] = np.nan  # whatever the untrained positions hold never counts
    sampler[0, ~mask[0]] = -np.inf
    return trainer, sampler, mask


def _metrics(trainer, sampler, mask, log_w=None):
    out = jax.jit(lambda t, s, m, w: mismatch_metrics(t, s, m, log_weight=w, **CAPS))(
        named(trainer), named(sampler), named(mask), None if log_w is None else named(log_w))
    assert sorted(out) == sorted(PREFIX + n for n in NAMES)
    return {k[len(PREFIX):]: float(v) for k, v in out.items()}


def test_token_level_metrics_match_numpy(data):
    trainer, sampler, mask = data
    got, want = _metrics(trainer, sampler, mask), np_reference(trainer, sampler, mask, **CAPS)
    for name in NAMES:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert 0 < want["tis_clipped_frac"] < want["mis_masked_frac"] < 1  # the data reaches both sides of the bounds


def test_a_sequence_level_weight_decides_what_tis_and_mis_count(data):
    """With sequence-level TIS/MIS every token of a row counts by the row's weight Σ_t d_t."""
    trainer, sampler, mask = data
    d = np.where(mask, trainer - sampler, 0.0)
    log_w = np.repeat(d.sum(axis=1, keepdims=True), POS, axis=1).astype(np.float32)
    got, want = _metrics(trainer, sampler, mask, log_w), np_reference(trainer, sampler, mask, **CAPS, log_w=log_w)
    for name in NAMES:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert got["tis_clipped_frac"] != _metrics(trainer, sampler, mask)["tis_clipped_frac"]


def test_identical_logprobs_give_zero_and_nothing_trained_gives_zero(data):
    _, sampler, mask = data
    same = np.where(mask, sampler, 0.0)
    assert all(v == 0.0 for v in _metrics(same, same, mask).values())
    assert all(v == 0.0 for v in _metrics(same, same - 1.0, np.zeros_like(mask)).values())


def test_k3_is_zero_only_at_zero_and_positive_elsewhere():
    d = np.array([[-3.0, -1e-2, 0.0, 1e-2, 3.0]], np.float32)
    got = np.asarray(k3(named(d)).array)
    x = d.astype(np.float64)
    # float32 rounds each of e^d, d and 1 to within eps32 of its size; the difference cancels, the rounding stays
    tolerance = 4 * np.finfo(np.float32).eps * (np.exp(x) + np.abs(x) + 1)
    assert (np.abs(got - (np.exp(x) - x - 1)) <= tolerance).all(), got
    assert got[0, 2] == 0 and (np.delete(got, 2) > 0).all()


def test_the_report_plots_every_mismatch_metric():
    from marinrl.report.page import MISMATCH_METRICS

    assert MISMATCH_METRICS == NAMES
