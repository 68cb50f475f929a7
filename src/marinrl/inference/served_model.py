"""The weights an `InferenceServer` serves: loaded straight onto the rollout mesh, cast to the serving dtype,
checked against the served ones on reload, and the sampler's cache budget and context read from them."""

from __future__ import annotations

import logging
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference import scan_plan, sharding
from marinrl.models.policy_model import abstract_model, build_model

logger = logging.getLogger(__name__)


def load_served_model(model_config: ModelConfig, config: InferenceServerConfig, dtype: Optional[str] = None):
    """The model `model_config` describes, in `dtype` (default: `model_config.dtype`), built straight onto
    the rollout mesh `config` asks for: the mesh is planned from the checkpoint's config file alone, then
    each weight is read (or initialized) already sharded, so no device holds the whole model unless the
    mesh has one device. `InferenceServer` then finds it in place (`sharding.place` copies nothing)."""
    where = sharding.rollout_mesh(abstract_model(model_config, dtype), config.model_axis_size)
    if where is None:
        return build_model(model_config, dtype=dtype)
    return build_model(model_config, axis_mapping=where.axis_mapping, mesh=where.mesh, dtype=dtype)


def scan_cache_budget(setting, mesh: Optional[sharding.RolloutMesh]) -> int:
    """The scan sampler's cache budget of one call per device for `inference.scan_max_cache_bytes` (`setting`):
    `auto` reads the allocator of the first rollout device now, with the served weights on it
    (`scan_plan.auto_cache_budget`); a number is taken as it is."""
    if setting != "auto":
        return int(setting)
    device = mesh.mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
    stats = device.memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    budget = scan_plan.auto_cache_budget(limit, used)
    where = f"device limit {limit / 2**30:.2f} GiB, {used / 2**30:.2f} GiB in use" if limit else "the CPU default"
    logger.info("scan sampler: a call's KV cache may take %.2f GiB a device (inference.scan_max_cache_bytes: auto, "
                "%s)", budget / 2**30, where)
    return budget


def model_context(model) -> Optional[int]:
    """The longest prompt + generation the model was built for (its config's `max_seq_len` or `seq_len`)."""
    cfg = model.config
    length = getattr(cfg, "max_seq_len", None) or getattr(cfg, "seq_len", None)
    return int(length) if length else None


def cast_floating(model, dtype: str):
    """`model` with every floating weight in `dtype` (itself when all already are)."""

    dtype = jnp.dtype(dtype)
    if all(x.dtype == dtype for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))):
        return model
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


def check_same_structure(old, new) -> None:
    """Raises ValueError unless `new` has `old`'s tree, shapes and dtypes: a reload swaps buffers, never a program."""

    a = jax.tree_util.tree_structure(eqx.filter(old, eqx.is_array))
    b = jax.tree_util.tree_structure(eqx.filter(new, eqx.is_array))
    if a != b:
        raise ValueError("reload: the new model's structure differs from the served one")
    for x, y in zip(jax.tree_util.tree_leaves(eqx.filter(old, eqx.is_array)),
                    jax.tree_util.tree_leaves(eqx.filter(new, eqx.is_array))):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"reload: a weight changed from {x.shape} {x.dtype} to {y.shape} {y.dtype}")
