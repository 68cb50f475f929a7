"""Sharding and gradient accumulation change how an update is computed, never what it is: the
TrainWorker's step (Levanter Trainer + our loss on a sharded TrainingBatch) on 4 fake CPU devices,
data-parallel and data × tensor-parallel, against a plain single-device computation."""

from __future__ import annotations

import functools

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest
from levanter.checkpoint import CheckpointerConfig
from levanter.trainer import Trainer

from marinrl.models import build_model
from marinrl.train.batching import BatchingConfig, make_training_batch
from marinrl.train.losses import LossConfig, rl_loss, token_logprobs
from marinrl.train.worker import StepInput, _default_optimizer, _step_loss, cpu_trainer_config
from test_train_worker import TINY, make_rollout_batch

LOSS = LossConfig.preset("grpo", kl_beta=0.04)
BATCHING = BatchingConfig(max_length=64, min_bucket=16)


def _batches(n: int):
    rng = np.random.default_rng(1)
    out = []
    for step in range(n):
        rollouts = [r for _ in range(2) for r in make_rollout_batch(step, rng).rollouts]  # 16 rows, none padding
        adv = rng.normal(size=len(rollouts)).astype(np.float32)
        out.append((rollouts, adv))
    return out


def _run_trainer(tmp_path, batches, **overrides) -> tuple[list[float], eqx.Module]:
    cfg = cpu_trainer_config(num_train_steps=len(batches), train_batch_size=16, log_dir=tmp_path / "logs",
                             tracker=(), id="mesh", checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt")),
                             **overrides)
    optimizer = _default_optimizer().build(cfg.num_train_steps)
    losses = []
    with Trainer(cfg, optimizer, functools.partial(_step_loss, config=LOSS), add_default_hooks=False) as trainer:
        state = trainer.initial_state(jax.random.PRNGKey(0), model_init=lambda: build_model(TINY))
        reference = build_model(TINY)
        ref_fn = hax.named_jit(token_logprobs, axis_resources=trainer.compute_axis_mapping)
        for rollouts, adv in batches:
            batch = hax.shard(make_training_batch(rollouts, adv, batch_size=16, config=BATCHING),
                              trainer.compute_axis_mapping)
            info = trainer.train_step(state, StepInput(batch, ref_fn(reference, batch)))
            state = info.state
            losses.append(info.loss)
        return losses, jax.device_get(state.model)


def _run_single_device(batches) -> tuple[list[float], eqx.Module]:
    """The same updates with no mesh and no Trainer: optax on one device."""
    device = jax.devices()[0]
    model = jax.device_put(build_model(TINY), device)
    reference = model
    optimizer = _default_optimizer().build(len(batches))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch, ref):
        (loss, _), grads = eqx.filter_value_and_grad(
            lambda m: rl_loss(m, batch, config=LOSS, reference_logprobs=ref), has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for rollouts, adv in batches:
        batch = jax.device_put(make_training_batch(rollouts, adv, batch_size=16, config=BATCHING), device)
        ref = token_logprobs(reference, batch)
        model, opt_state, loss = step(model, opt_state, batch, ref)
        losses.append(float(loss))
    return losses, jax.device_get(model)


def _max_param_diff(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(eqx.filter(a, eqx.is_array)), jax.tree_util.tree_leaves(eqx.filter(b, eqx.is_array))
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def single_device():
    return _run_single_device(_batches(3))


def test_four_fake_devices_are_available():
    assert len(jax.devices()) == 4


@pytest.mark.parametrize(
    "mesh",
    [dict(), dict(model_axis_size=2, tensor_parallel_axes=["mlp", "heads"]), dict(per_device_parallelism=2)],
    ids=["data_parallel_4", "data2_x_tensor2", "grad_accum_2_microbatches"],
)
def test_sharded_updates_match_one_device(tmp_path, single_device, mesh):
    ref_losses, ref_model = single_device
    losses, model = _run_trainer(tmp_path, _batches(3), **mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-6)
    assert _max_param_diff(model, ref_model) < 5e-6
    assert losses[1] != losses[0]  # the updates did something
