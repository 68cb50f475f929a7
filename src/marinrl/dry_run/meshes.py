"""The meshes a job's roles run on, from its placements and mesh settings alone: how many devices the trainer
and a rollout worker have, the trainer's FSDP mesh, and the rollout's tensor-parallel axis and mapping."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from marinrl.dry_run.engine_cache import RolloutDevice, rollout_device
from marinrl.dry_run.shapes import abstract_model, total_bytes
from marinrl.levanter_configs import to_levanter


def trainer_devices(job) -> int:
    """The trainer mesh's devices: its placement's per host × hosts (`v5p-64`: 4 × 8), else 8."""
    per_host = job.ray.trainer.devices()
    return per_host * job.ray.trainer.hosts() if per_host else 8


def rollout_devices(job) -> int:
    """The devices one rollout worker sees: its placement's, else all of this process's."""
    n = job.ray.rollout.devices()
    return n if n is not None else len(jax.devices())


def trainer_mesh(job, n_devices: int) -> dict:
    """Levanter's FSDP mesh over `n_devices` (`create_fsdp_mesh`): replica × data × model."""
    t = job.trainer
    replica = t.replica_ici_axis_size * t.replica_dcn_axis_size
    model = t.model_axis_size
    if n_devices % (replica * model):
        raise ValueError(f"trainer.model_axis_size ({model}) × replica axes ({replica}) does not divide the "
                         f"trainer's {n_devices} devices")
    return {"replica": replica, "data": n_devices // (replica * model), "model": model}


def rollout_model_axis_size(job, n_devices: int, device: Optional[RolloutDevice] = None) -> int:
    """`inference.model_axis_size`, else the accelerator's default (`sharding.choose_model_axis_size`): 1 (data
    parallel) where one `device` (else the placement's) holds the weights with room to spare, else the largest
    divisor of `n_devices` that splits the model's heads, KV heads and MLP."""
    from marinrl.inference import sharding

    cfg = to_levanter(job.model.model)
    size = job.inference.model_axis_size
    if size is None:
        device = device or rollout_device(job)
        weights = total_bytes(abstract_model(cfg, job.model.vocab_size, jnp.dtype(job.rollout_dtype())))
        size = sharding.choose_model_axis_size(n_devices, cfg.num_kv_heads, cfg.num_heads, cfg.intermediate_dim,
                                               weights, device.memory_bytes)
    for what, n in (("the rollout devices", n_devices), ("num_kv_heads", cfg.num_kv_heads),
                    ("num_heads", cfg.num_heads), ("intermediate_dim", cfg.intermediate_dim)):
        if n % size:
            raise ValueError(f"inference.model_axis_size is {size}, which does not divide {what} ({n})")
    return size


def rollout_mapping(job, model_axis_size: int) -> dict:
    from marinrl.inference import sharding

    mapping = {axis: sharding.MODEL for axis in sharding.TENSOR_PARALLEL_AXES}
    if job.model.vocab_size % model_axis_size == 0:
        mapping["vocab"] = sharding.MODEL
    return mapping
