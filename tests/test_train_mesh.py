"""Sharding and gradient accumulation change how an update is computed, never what it is: the
TrainWorker's step (Levanter Trainer + our loss on a sharded TrainingBatch) on 4 fake CPU devices,
data-parallel and data × tensor-parallel, against a plain single-device computation.

The bounds follow from float32, not from one machine's results: the sharded and the single-device
runs sum the same terms in different orders (XLA's CPU kernels differ by CPU kind too), and a sum of
n float32 terms is exact to about n · eps32 · Σ|terms| at worst. The updates use plain SGD: the
weight change is then −lr · gradient, linear in the gradient, so a gradient error maps to a weight
error of the same relative size. (Adam divides by sqrt(v): on a coordinate whose gradient is near
zero a rounding-level gradient difference moves the update by a sizable fraction of lr, which is why
a bound on Adam's weights can only come from one machine's numbers.)"""

from __future__ import annotations

import functools

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import optax
import pytest
from levanter.checkpoint import CheckpointerConfig
from levanter.trainer import Trainer
from test_train_worker import TINY, make_rollout_batch

from marinrl.config.batching import BatchingConfig
from marinrl.config.loss import LossConfig
from marinrl.levanter_configs import cpu_trainer_config
from marinrl.models.policy_model import build_model
from marinrl.train.batching import make_training_batch, row_alignment
from marinrl.train.losses import rl_loss, token_logprobs
from marinrl.train.worker import StepInput, _step_loss

LOSS = LossConfig.preset("grpo", kl_beta=0.04)
BATCHING = BatchingConfig(max_length=64, min_bucket=16, layout="packed")  # one rollout per row: 16 rows, 2 microbatches
ROWS, STEPS = 16, 3
LR = 0.5  # large enough that every step moves the weights far beyond the rounding bound below
EPS32 = float(np.finfo(np.float32).eps)


def _optimizer():
    return optax.sgd(LR)


def _batches(n: int):
    rng = np.random.default_rng(1)
    out = []
    for step in range(n):
        rollouts = [r for _ in range(2) for r in make_rollout_batch(step, rng).rollouts]  # 16 rows, none padding
        adv = rng.normal(size=len(rollouts)).astype(np.float32)
        out.append((rollouts, adv))
    return out


def _run_trainer(tmp_path, batches, **overrides) -> tuple[list[float], eqx.Module]:
    cfg = cpu_trainer_config(num_train_steps=len(batches), train_batch_size=ROWS, log_dir=tmp_path / "logs",
                             tracker=(), id="mesh", checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt")),
                             **overrides)
    losses = []
    with Trainer(cfg, _optimizer(), functools.partial(_step_loss, config=LOSS), add_default_hooks=False) as trainer:
        state = trainer.initial_state(jax.random.PRNGKey(0), model_init=lambda: build_model(TINY))
        reference = build_model(TINY)
        ref_fn = hax.named_jit(token_logprobs, axis_resources=trainer.compute_axis_mapping)
        for rollouts, adv in batches:
            batch = hax.shard(make_training_batch(rollouts, adv, batch_size=ROWS, config=BATCHING,
                                                  **row_alignment(trainer.config)),
                              trainer.compute_axis_mapping)
            info = trainer.train_step(state, StepInput(batch, ref_fn(reference, batch)))
            state = info.state
            losses.append(info.loss)
        return losses, jax.device_get(state.model)


def _run_single_device(batches) -> tuple[list[float], list[eqx.Module], int]:
    """The same updates with no mesh and no Trainer: optax on one device. Returns the losses, the
    weights before and after every step, and the loss-mask token count of the largest batch."""
    device = jax.devices()[0]
    model = jax.device_put(build_model(TINY), device)
    reference = model
    optimizer = _optimizer()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch, ref):
        (loss, _), grads = eqx.filter_value_and_grad(
            lambda m: rl_loss(m, batch, config=LOSS, reference_logprobs=ref), has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses, models, positions = [], [jax.device_get(model)], 0
    for rollouts, adv in batches:
        batch = jax.device_put(make_training_batch(rollouts, adv, batch_size=ROWS, config=BATCHING), device)
        positions = max(positions, int(np.prod(batch.loss_mask.array.shape)))
        ref = token_logprobs(reference, batch)
        model, opt_state, loss = step(model, opt_state, batch, ref)
        losses.append(float(loss))
        models.append(jax.device_get(model))
    return losses, models, positions


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))]


def weight_bounds(models: list, n_terms: int) -> list[float]:
    """Per parameter array: how far two float32 computations of the same SGD steps may drift apart.

    Step t changes the weights by Δ_t = −lr·g_t. Each gradient element sums at most `n_terms` token
    contributions (batch × position; the hidden-size sums inside are shorter): two summation orders
    differ by at most n·eps32·Σ|terms|, and we take Σ|terms| ≈ |g| (first order), so the weights may
    differ by n·eps32·Σ_t max|Δ_t|, plus a few eps32·|w| per step for rounding the weights themselves.
    A safety factor of 4 covers the second-order terms (later gradients at slightly different weights)."""
    bounds = []
    for i, _w_final in enumerate(_leaves(models[-1])):
        update_scale = sum(float(np.max(np.abs(_leaves(b)[i] - _leaves(a)[i]))) for a, b in zip(models, models[1:]))
        weight_scale = max(float(np.max(np.abs(_leaves(m)[i]))) for m in models)
        bounds.append(4 * EPS32 * (n_terms * update_scale + len(models) * weight_scale))
    return bounds


@pytest.fixture(scope="module")
def single_device():
    return _run_single_device(_batches(STEPS))


def test_four_fake_devices_are_available():
    assert len(jax.devices()) == 4


@pytest.mark.parametrize(
    "mesh",
    [dict(), dict(model_axis_size=2, tensor_parallel_axes=["mlp", "heads"]), dict(per_device_parallelism=2)],
    ids=["data_parallel_4", "data2_x_tensor2", "grad_accum_2_microbatches"],
)
def test_sharded_updates_match_one_device(tmp_path, single_device, mesh):
    ref_losses, ref_models, n_terms = single_device
    losses, model = _run_trainer(tmp_path, _batches(STEPS), **mesh)
    # The loss is a masked mean of per-token terms |ratio·A| ≤ (1+ε)·max|A| plus a KL of order 1: the same
    # n·eps32 rule on that scale (its inputs, the weights, agree to the bound checked below).
    max_adv = max(float(np.max(np.abs(adv))) for _, adv in _batches(STEPS))
    loss_atol = 4 * EPS32 * n_terms * (1.2 * max_adv + 1.0)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=loss_atol)
    bounds = weight_bounds(ref_models, n_terms)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(_leaves(model), _leaves(ref_models[-1]))]
    steps = [float(np.max(np.abs(a - b))) for a, b in zip(_leaves(ref_models[-1]), _leaves(ref_models[0]))]
    assert all(d <= b for d, b in zip(diffs, bounds)), list(zip(diffs, bounds))
    # The bound is far below what the updates moved: an update computed wrongly (a lost microbatch,
    # a shard counted twice) cannot hide in it.
    assert sum(s > 20 * b for s, b in zip(steps, bounds)) >= len(bounds) // 2, list(zip(steps, bounds))
    assert losses[1] != losses[0]  # the updates did something
