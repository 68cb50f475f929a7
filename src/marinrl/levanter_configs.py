"""Levanter's config objects for marinrl's mirrors of them. The job's config layer (config/model.py,
config/trainer.py) declares the Levanter knobs it exposes as plain dataclasses named `LEVANTER =
"module:Class"`, so a config parses and is checked without importing Levanter (seconds and hundreds of
MB); the runtime asks for the real object here. A field keeps its name; the few whose YAML form differs
from Levanter's Python type are converted below (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


def to_levanter(config: Any) -> Any:
    """Levanter's config for `config`, a marinrl mirror; anything else (Levanter's own object, None) is
    returned as it is."""
    target = getattr(type(config), "LEVANTER", "")
    if not target:
        return config
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(**{f.name: _converted(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)})


def gradient_checkpointing_policy(value: Any) -> Any:
    """`model.gradient_checkpointing` as Levanter takes it. `auto` is the trainer's to resolve, from its device's
    memory (`job.plan.train_worker_config`); a model built anywhere else (a rollout worker's, an evaluation's:
    forward passes only, where the policy changes nothing) takes Levanter's default, True."""
    return True if isinstance(value, str) and value == "auto" else value


def attention_backend(value: Any) -> Any:
    """`model.attn_backend` as Levanter takes it (an `AttentionBackend`) for a model built in this process:
    `auto` resolved for this process's device (`config.model.attention_backend_here`); None and Levanter's own
    enum pass through."""
    if not isinstance(value, str):
        return value
    import jax
    from levanter.layers.attention import AttentionBackend

    from marinrl.config.model import attention_backend_here

    if value == "default":
        return AttentionBackend.DEFAULT
    return AttentionBackend(attention_backend_here(value, jax.default_backend()))


def _converted(field: str, value: Any) -> Any:
    if field == "gradient_checkpointing":
        return gradient_checkpointing_policy(value)
    if field == "attn_backend":
        return attention_backend(value)
    if field == "per_device_parallelism" and value == "auto":
        return -1  # resolved by the trainer (`job.plan.train_worker_config`); unresolved: the whole batch
    if field == "mp" and isinstance(value, str):
        import jmp

        return jmp.get_policy(value)
    if field == "activation_function" and isinstance(value, str):
        from levanter.utils.activation import ActivationFunctionEnum

        return ActivationFunctionEnum(value)
    if getattr(type(value), "LEVANTER", ""):  # a nested mirror (the rope of an architecture, a tracker)
        return to_levanter(value)
    if field == "tracker" and isinstance(value, (tuple, list)):
        return tuple(to_levanter(t) for t in value)
    if field in ("axis_resources", "parameter_axis_resources"):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    if isinstance(value, list):
        return list(value)
    return value


def trainer_config(job, policy_model=None):
    """Levanter's `TrainerConfig` of an `RLJobConfig`: `job.trainer` with what the job derives filled in; with
    `policy_model` (a `config.policies.PolicyModel`), that model's trainer: its run id, directory and host."""
    run_id, run_dir, placement = ((job.run_id, job.run_dir, job.ray.trainer) if policy_model is None else
                                  (policy_model.run_id, policy_model.run_dir, policy_model.placement))
    return levanter_trainer(job.trainer, num_train_steps=job.num_train_steps,
                            train_batch_size=job.groups_per_step * job.n_generations, run_id=run_id,
                            seed=job.seed, run_dir=run_dir, require_accelerator=placement.has_accelerator)


def levanter_trainer(trainer, *, num_train_steps: int, train_batch_size: int, run_id: str, seed: int, run_dir: str,
                     require_accelerator: bool):
    """Levanter's `TrainerConfig` for a job's `trainer` (config/trainer.py) with what the job derives:
    the steps, the batch, the run's id and seed, logs and checkpoints under the run directory, no Ray and
    no watch hooks of Levanter's own, TensorBoard left at its default logdir moved under the run.

    Levanter never calls `jax.distributed.initialize` here: a trainer of several processes joins its group
    through `marinrl.multihost` with an explicit coordinator, and for one process Levanter's detection only
    does harm: it counts a GPU image with mpi4py installed as a cluster (then JAX asks for a coordinator
    address: seen on an H100 node, docs/device_check.md), and a process on part of a TPU VM
    would join the VM's slice with the port every process on the host shares."""
    import pathlib

    from levanter.callbacks.watch import WatchConfig
    from levanter.checkpoint import CheckpointerConfig
    from levanter.distributed import DistributedConfig, RayConfig
    from levanter.tracker.tensorboard import TensorboardConfig

    config = to_levanter(trainer)
    if config is trainer:  # Levanter's own TrainerConfig, handed in from Python
        return config
    trackers = config.tracker if isinstance(config.tracker, (tuple, list)) else (config.tracker,)
    trackers = tuple(dataclasses.replace(t, logdir=f"{run_dir}/tensorboard/trainer")
                     if isinstance(t, TensorboardConfig) and t.logdir == TensorboardConfig().logdir else t
                     for t in trackers)
    return dataclasses.replace(
        config, num_train_steps=num_train_steps, train_batch_size=train_batch_size, id=run_id, seed=seed,
        log_dir=pathlib.Path(run_dir) / "logs", tracker=trackers if len(trackers) != 1 else trackers[0],
        checkpointer=CheckpointerConfig(base_path=f"{run_dir}/checkpoints", append_run_id_to_base_path=False),
        ray=RayConfig(auto_start_cluster=False), watch=WatchConfig(watch_targets=[]),
        distributed=DistributedConfig(initialize_jax_distributed=False),
        require_accelerator=require_accelerator if trainer.require_accelerator is None else trainer.require_accelerator)


def cpu_trainer_config(**overrides):
    """A `TrainerConfig` that works on a laptop CPU: no accelerator required, no Ray of its own, no
    `jax.distributed` of Levanter's own (`levanter_trainer` says why), offline JSON tracking, no second compile
    for watch hooks."""
    import pathlib

    from levanter.callbacks.watch import WatchConfig
    from levanter.distributed import DistributedConfig, RayConfig
    from levanter.tracker.json_logger import JsonLoggerConfig
    from levanter.trainer import TrainerConfig

    defaults: dict[str, Any] = dict(
        require_accelerator=False,
        ray=RayConfig(auto_start_cluster=False),
        distributed=DistributedConfig(initialize_jax_distributed=False),
        tracker=JsonLoggerConfig(),
        watch=WatchConfig(watch_targets=[]),
        log_dir=pathlib.Path("logs"),
        log_jaxprs=False,
        log_xla_hlo=False,
        num_train_steps=100,
        train_batch_size=64,
    )
    defaults.update(overrides)
    return TrainerConfig(**defaults)


def name_the_trainer_log_once() -> None:
    """Levanter's `TrainerConfig.initialize` passes `f"{id}.log"` to `init_logging`, which appends ".log"
    itself: the trainer's log was `<run_id>.log.log`. Strips the extra suffix before Levanter adds its own
    (idempotent; Levanter looks the function up on its module at every call)."""
    import levanter.utils.logging as levanter_logging

    init = levanter_logging.init_logging
    if getattr(init, "__wrapped__", None) is not None:
        return

    def init_logging(log_dir, run_id: str, *args, **kwargs):
        return init(log_dir, run_id.removesuffix(".log"), *args, **kwargs)

    init_logging.__wrapped__ = init
    levanter_logging.init_logging = init_logging
