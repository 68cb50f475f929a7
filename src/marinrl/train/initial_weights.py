"""Where the trainer's policy and frozen reference start from, read once per process and never traced.

Levanter's `Trainer.initial_state` runs its `model_init` under `jit` (and under `eval_shape`). A
`model_init` that reads a checkpoint there traces the read: every weight becomes a constant of the
program (the whole checkpoint compiled into it, on every host) and the read runs once per trace. So a
checkpoint is read here, eagerly, before Levanter is asked for a state:

- the weights come straight onto the trainer's mesh, each tensor sharded by its parameter axis mapping
  (`marinrl.models.policy_model.build_model`), at most once per process (`CheckpointWeights`);
- they enter Levanter's program as an *argument* (`jax.tree_util.Partial`), which it donates: the
  policy takes the loaded buffers over, no copy;
- a resume needs no weights from the checkpoint (the trainer's own checkpoint holds the policy), so its
  `model_init` is the same architecture's random initializer, whose values the loaded state replaces
  (XLA drops the unused computation); with LoRA the frozen base is not in the trainer's checkpoint, so
  it is read (once) on every start;
- the reference is a device copy of the freshly loaded policy, or, on a resume, the checkpoint read then.

A model built from scratch (no checkpoint) initializes under Levanter's jit as before: its program
holds a seed, not weights. docs/models.md, "Loading".
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, Union

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.trainer import Trainer

from marinrl.config.model import ModelConfig
from marinrl.models import lora as lora_rl
from marinrl.models.adapter_stack import adapted_model
from marinrl.models.policy_model import build_model, init_model, model_architecture


class CheckpointWeights:
    """The weights of `config`'s checkpoint on the trainer's mesh, read on first use and kept until a
    program donates them (then read again only if asked again, which only a failed resume attempt does)."""

    def __init__(self, config: ModelConfig, trainer: Trainer):
        self.config = config
        self._trainer = trainer
        self._model = None

    @property
    def from_checkpoint(self) -> bool:
        return bool(self.config.hf_checkpoint or self.config.levanter_checkpoint)

    def get(self):
        if self._model is None or _donated(self._model):
            t = self._trainer
            self._model = build_model(self.config, axis_mapping=t.parameter_axis_mapping, mesh=t.device_mesh)
        return self._model

    def release(self) -> None:
        """Drop this process's reference (the loaded buffers then belong to whoever took them)."""
        self._model = None


def _donated(model) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def _identity(model):
    return model


Adapters = Union[lora_rl.LoraRLConfig, Sequence[lora_rl.LoraRLConfig], None]
"""What the model is adapted with: nothing, one adapter, or several stacked on one base (one config each)."""


def fresh_model_init(source: CheckpointWeights, lora: Adapters) -> Callable:
    """Levanter's `model_init` for a start from `source.config`: the loaded weights as an argument of the
    init program (a `Partial` is a pytree: its arrays are traced as inputs, never as constants), or the
    seeded initializer when there is no checkpoint."""
    if not source.from_checkpoint:
        init = functools.partial(build_model, source.config)
        return init if lora is None else (lambda: adapted_model(init(), lora))
    base = source.get()
    if lora is None:
        return jax.tree_util.Partial(_identity, base)
    return jax.tree_util.Partial(lambda m: adapted_model(m, lora), base)


def resume_model_init(source: CheckpointWeights, lora: Adapters) -> Callable:
    """Levanter's `model_init` when the state comes from the trainer's own checkpoint. Without LoRA that
    checkpoint holds every weight: the init is a seeded one of the same architecture and dtype (its shapes
    are what Levanter reads; its values are dropped), so nothing reads the source checkpoint. With LoRA
    the frozen base is not checkpointed and comes from the source, as on a fresh start."""
    if lora is not None or not source.from_checkpoint:
        return fresh_model_init(source, lora)
    config = source.config
    lev, vocab = model_architecture(config)
    return functools.partial(init_model, lev, vocab, seed=config.seed, dtype=jnp.dtype(config.dtype))


def build_reference(source: CheckpointWeights, trainer: Trainer, initial_policy=None):
    """The frozen reference model, built as Levanter builds the policy: under the trainer's global mesh,
    sharded by its parameter axis mapping, so each process builds (or reads) only its own shards and the
    reference logprobs run SPMD like the loss. A from-scratch init draws the same values as the policy's
    (same seed), so the KL starts at 0 on one host or several.

    `initial_policy`: the policy as freshly initialized from the config (`is_initial_policy`): the
    reference is a device copy of it (the train step donates the policy's buffers), which skips
    compiling the initializer a second time, or reading the checkpoint again."""
    if initial_policy is not None:
        with hax.partitioning.set_mesh(trainer.device_mesh):
            return hax.named_jit(lambda m: jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, m),
                                 out_axis_resources=trainer.parameter_axis_mapping)(initial_policy)
    return source.get() if source.from_checkpoint else build_model(
        source.config, axis_mapping=trainer.parameter_axis_mapping, mesh=trainer.device_mesh)


def is_initial_policy(config: ModelConfig, trainer: Trainer, state, resumed: bool) -> bool:
    """Whether `state.model` holds exactly `build_model(config)`: a fresh start (no resume, no Levanter
    `initialize_from` or `load_checkpoint_path`, step 0), no quantization, and every floating weight
    kept in `config.dtype` (a mixed-precision cast to another parameter dtype would change values)."""
    tc = trainer.config
    if resumed or int(state.step) != 0 or tc.initialize_from or tc.load_checkpoint_path or tc.quantization:
        return False
    dtype = jnp.dtype(config.dtype)
    return all(x.dtype == dtype for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array)))


def frozen_reference(source: CheckpointWeights, trainer: Trainer, state, resumed: bool):
    """The KL reference for a policy whose state was just loaded: a copy of the policy when it is exactly the
    config's fresh init (`is_initial_policy`), else built or read from `source`."""
    fresh = is_initial_policy(source.config, trainer, state, resumed=resumed)
    return build_reference(source, trainer, initial_policy=state.model if fresh else None)
