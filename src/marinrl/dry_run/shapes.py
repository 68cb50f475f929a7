"""Abstract shapes and their bytes: the model as ShapeDtypeStructs (`eqx.filter_eval_shape`, no weights) and
the bytes of a pytree's shard on its most loaded device under haliax's axis mapping, so a plan is counted from
shapes and shardings alone, for any device count, without building a weight."""

from __future__ import annotations

import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from marinrl.levanter_configs import to_levanter

GiB = float(1 << 30)


def abstract_model(model_config, vocab_size: int, dtype):
    """The model as ShapeDtypeStructs (no weights): its floating leaves in `dtype`."""
    model_config = to_levanter(model_config)

    def init():
        model = model_config.model_type.init(hax.Axis("vocab", vocab_size), model_config, key=jax.random.PRNGKey(0))
        return cast_floats(model, dtype)

    return eqx.filter_eval_shape(init)


def cast_floats(tree, dtype):
    def cast(x):
        if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating):
            return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=x.sharding)
        if eqx.is_inexact_array(x):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def _arrays(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, (jax.ShapeDtypeStruct, jax.Array))]


def shard_bytes(tree, mapping: dict, mesh: dict) -> float:
    """Bytes of `tree`'s shard on its most loaded device when haliax lays it out by `mapping` (logical
    axis -> mesh axis) on a mesh of these axis sizes; leaves that are not NamedArrays are replicated."""
    specs = hax.partitioning.pspec_for(tree, mapping, preserve_existing_shardings=False)
    leaves = jax.tree_util.tree_leaves(tree)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(leaves) != len(spec_leaves):
        raise AssertionError(f"haliax gave {len(spec_leaves)} partition specs for {len(leaves)} leaves")
    total = 0.0
    for x, spec in zip(leaves, spec_leaves):
        if not isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
            continue
        shape = list(x.shape)
        for i, axes in enumerate(tuple(spec) if isinstance(spec, PartitionSpec) else ()):
            for name in (axes if isinstance(axes, tuple) else (axes,)):
                if name is not None:
                    shape[i] = -(-shape[i] // mesh.get(name, 1))
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def total_bytes(tree) -> float:
    return float(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in _arrays(tree)))


def count(tree) -> int:
    return int(sum(math.prod(x.shape) for x in _arrays(tree)))
