"""Startup work the actors skip: torch where nothing needs it, and the trainer's second initializer
compile for a reference that equals the initial policy (docs/performance.md, "First step", "Memory")."""

from __future__ import annotations

import os
import subprocess
import sys

import equinox as eqx

from marinrl.job.actors import actor_env

_CHILD = """
import sys, tempfile
import marinrl.job.rl_job  # what an actor imports first: Levanter, transformers
from marinrl.startup import import_tensorboardx_without_torch
import_tensorboardx_without_torch()
from levanter.tracker.tensorboard import TensorboardConfig
tracker = TensorboardConfig(logdir=tempfile.mkdtemp()).init("run")
tracker.log({"loss": 1.0}, step=0)
tracker.finish()
print("torch loaded:", "torch" in sys.modules)
import torch  # still importable for whoever needs it (Levanter's pytorch_model.bin reader)
print("torch importable:", hasattr(torch, "tensor"))
"""


def test_actors_run_with_use_torch_0_unless_the_driver_sets_it(monkeypatch):
    monkeypatch.delenv("USE_TORCH", raising=False)
    assert actor_env()["USE_TORCH"] == "0"
    monkeypatch.setenv("USE_TORCH", "1")
    assert actor_env()["USE_TORCH"] == "1"


def test_an_actor_logs_to_tensorboard_without_importing_torch():
    env = {**os.environ, "USE_TORCH": "0", "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch loaded: False" in out.stdout and "torch importable: True" in out.stdout, out.stdout


def test_a_fresh_trainer_copies_its_reference_from_the_initial_policy(tmp_path):
    """The reference of a fresh start is a copy of the initial policy (no second initializer compile):
    the same values as the reference built from the config, in buffers of its own, which the train
    step's donation of the policy leaves intact."""
    import dataclasses
    import functools

    import jax
    import numpy as np
    import optax
    from levanter.checkpoint import CheckpointerConfig
    from levanter.trainer import Trainer
    from test_train_worker import TINY

    from marinrl.config.loss import LossConfig
    from marinrl.levanter_configs import cpu_trainer_config
    from marinrl.models.policy_model import build_model
    from marinrl.train.initial_weights import CheckpointWeights, build_reference
    from marinrl.train.initial_weights import is_initial_policy as _is_initial_policy
    from marinrl.train.worker import _step_loss

    cfg = cpu_trainer_config(num_train_steps=1, train_batch_size=4, log_dir=tmp_path / "logs", tracker=(), id="ref",
                             checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt")))
    loss = functools.partial(_step_loss, config=LossConfig.preset("grpo", kl_beta=0.04))
    with Trainer(cfg, optax.sgd(0.1), loss, add_default_hooks=False) as trainer:
        state = trainer.initial_state(jax.random.PRNGKey(0), model_init=lambda: build_model(TINY))
        assert _is_initial_policy(TINY, trainer, state, resumed=False)
        assert not _is_initial_policy(TINY, trainer, state, resumed=True)
        assert not _is_initial_policy(dataclasses.replace(TINY, dtype="bfloat16"), trainer, state, resumed=False)
        copied = build_reference(CheckpointWeights(TINY, trainer), trainer, initial_policy=state.model)
        built = build_reference(CheckpointWeights(TINY, trainer), trainer)
        leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
        for c, b, p in zip(leaves(copied), leaves(built), leaves(state.model), strict=True):
            np.testing.assert_array_equal(np.asarray(c), np.asarray(b))
            pointers = lambda x: {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}  # noqa: E731
            assert not pointers(c) & pointers(p)
