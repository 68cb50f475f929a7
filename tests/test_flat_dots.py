"""flat_dots.py: the projections' dots with the token axes merged compute what Levanter's 3-D dots compute,
and really run as 2-D matmuls in the policy forward (the reason they exist: docs/performance.md)."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from haliax.quantization import DefaultDotGeneralOp
from test_packing import _init_llama, arrays_for, bound, make_rollouts

from marinrl.config.loss import LossConfig
from marinrl.train.batching import TrainingBatch
from marinrl.train.flat_dots import TokenFlatDot, flat_token_dots, levanter_dots
from marinrl.train.losses import rl_loss


@pytest.mark.parametrize("lhs_shape, rhs_shape, numbers", [
    ((4, 5, 6), (7, 6), (((2,), (1,)), ((), ()))),         # [batch, position, in] · [out, in]: merged
    ((3, 4, 5, 6), (6, 7), (((3,), (0,)), ((), ()))),      # three leading axes, weight [in, out]: merged
    ((4, 5, 2, 3), (7, 2, 3), (((2, 3), (1, 2)), ((), ()))),  # two contracted axes (heads × head size): merged
    ((6, 4, 5), (6, 7), (((0,), (0,)), ((), ()))),         # contracted axis first: left as it is
    ((2, 4, 6), (2, 6, 7), (((2,), (1,)), ((0,), (0,)))),  # batch dimensions: left as it is
    ((4, 6), (7, 6), (((1,), (1,)), ((), ()))),            # one free axis: nothing to merge
])
def test_token_flat_dot_equals_dot_general(lhs_shape, rhs_shape, numbers):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    lhs, rhs = jax.random.normal(k1, lhs_shape), jax.random.normal(k2, rhs_shape)
    want = jax.lax.dot_general(lhs, rhs, numbers)
    got = TokenFlatDot()(lhs, rhs, numbers)
    assert got.shape == want.shape
    terms = int(np.prod([lhs_shape[d] for d in numbers[0][0]]))
    np.testing.assert_allclose(got, want, rtol=0, atol=bound(float(jnp.abs(lhs).max() * jnp.abs(rhs).max()), terms))


def _dot_lhs_ranks(fn, *args) -> list[int]:
    """The rank of the left operand of every dot_general in fn's jaxpr (nested jaxprs included)."""
    ranks = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                ranks.append(len(eqn.invars[0].aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return ranks


def test_flat_token_dots_swaps_every_projection_and_leaves_the_model_alone():
    llama = _init_llama(jax.random.PRNGKey(0))
    is_op = lambda x: isinstance(x, (DefaultDotGeneralOp, TokenFlatDot))  # noqa: E731
    ops = lambda m: [type(x) for x in jax.tree_util.tree_leaves(m, is_leaf=is_op) if is_op(x)]  # noqa: E731
    before = ops(llama)
    # scanned layers (one stacked module for both): q, k, v, o, gate, up, down + the LM head
    assert before == [DefaultDotGeneralOp] * 8
    flat = flat_token_dots(llama)
    assert ops(flat) == [TokenFlatDot] * 8
    assert ops(llama) == before  # the trainer's model keeps Levanter's structure
    # the same arrays: nothing is copied or reordered
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(llama), jax.tree_util.tree_leaves(flat)))


def _loss_fn(model, batch, config):
    return rl_loss(model, batch, config=config, reference_logprobs=None)[0]


def test_the_policy_forward_runs_its_projections_as_2d_matmuls():
    llama = _init_llama(jax.random.PRNGKey(0))
    batch = TrainingBatch.from_numpy(arrays_for(make_rollouts(0), "shared"))
    config = LossConfig.preset("grpo", kl_beta=0.0)
    grad = jax.grad(functools.partial(_loss_fn, batch=batch, config=config))
    params, static = eqx.partition(llama, eqx.is_inexact_array)
    ranks = _dot_lhs_ranks(lambda p: grad(eqx.combine(p, static)), params)
    # The 7 projections of a layer (one scanned body) run their forward and their gradients' products on
    # [tokens, features] operands (17 two-dimensional dots in all here); Levanter's own dots are all 3-D or more.
    without = _dot_lhs_ranks(lambda p: jax.grad(lambda m: _plain_loss(m, batch, config))(eqx.combine(p, static)),
                             params)
    assert without.count(2) == 0
    assert ranks.count(2) >= 7 * 2


def _plain_loss(model, batch, config):
    return _loss_fn(levanter_dots(model), batch, config)


@eqx.filter_jit
def _value_and_grad(model, batch, config, plain: bool):
    fn = _plain_loss if plain else _loss_fn
    return eqx.filter_value_and_grad(fn)(model, batch, config)


def test_loss_and_gradient_equal_levanters_dots():
    llama = _init_llama(jax.random.PRNGKey(0))
    arrays = arrays_for(make_rollouts(1), "shared")
    batch = TrainingBatch.from_numpy(arrays)
    config = LossConfig.preset("grpo", kl_beta=0.0)
    tokens = int(arrays["loss_mask"].sum())
    want_loss, want = _value_and_grad(llama, batch, config, True)
    loss, got = _value_and_grad(llama, batch, config, False)
    assert abs(float(want_loss)) > 1e-3
    assert abs(float(loss) - float(want_loss)) <= bound(8.0, tokens)
    for g, w in zip(jax.tree_util.tree_leaves(eqx.filter(got, eqx.is_inexact_array)),
                    jax.tree_util.tree_leaves(eqx.filter(want, eqx.is_inexact_array))):
        w = np.asarray(w)
        assert np.abs(w).max() > 0
        # a weight's gradient sums one term per token position; the two orders differ by rounding only
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=bound(float(np.abs(w).max()), 4 * tokens))
