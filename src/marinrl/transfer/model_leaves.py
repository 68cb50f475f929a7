"""A model as the named arrays a weight version carries: its array leaves by Levanter's checkpoint names, copied
to the host (`host_leaves`) or cast to the publish dtype (`cast_for_publish`), and the `ModelSkeleton` a client
rebuilds a model from (structure, static fields, each leaf's name, shape, dtype and placement).
"""

from __future__ import annotations

import functools
from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from haliax.util import is_named_array
from levanter.utils.jax_utils import leaf_key_paths

from marinrl.transfer.errors import WeightFormatError, WeightPublishError


def _is_array_leaf(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def array_tree(model):
    """(array leaves, everything else); a skeleton may hold ShapeDtypeStructs (`eqx.filter_eval_shape`)."""
    return eqx.partition(model, _is_array_leaf)


def leaf_names(arrays) -> list[str]:
    """Dotted names of the array leaves, in `jax.tree.leaves` order: Levanter's checkpoint names."""
    names = jax.tree.leaves(leaf_key_paths(arrays, is_leaf=is_named_array))
    n_leaves = len(jax.tree.leaves(arrays))
    if len(names) != n_leaves or len(set(names)) != n_leaves:
        raise WeightFormatError(f"cannot name the {n_leaves} array leaves of the model uniquely (got {len(names)})")
    return names


def host_leaves(model) -> tuple[list[str], list[np.ndarray]]:
    """The model's array leaves as named NumPy arrays on this host (a device-to-host copy).

    Needs every leaf fully addressable from this process; a model sharded over several hosts
    goes through the tensorstore format instead, where each host writes its own shards.
    """
    arrays, _ = array_tree(model)
    names = leaf_names(arrays)
    leaves = jax.tree.leaves(arrays)
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise WeightPublishError(
                f"leaf {name} is not fully addressable from process {jax.process_index()}: "
                "a model sharded over several hosts needs the filesystem mode with format='tensorstore'"
            )
    return names, [np.asarray(leaf) for leaf in jax.device_get(leaves)]


def floating_dtypes(model) -> list[str]:
    """The distinct dtypes of the model's floating array leaves, by name (for logs: "bfloat16")."""
    arrays, _ = array_tree(model)
    names = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(arrays) if jnp.issubdtype(x.dtype, jnp.floating)}
    return sorted(names)


def cast_for_publish(model, dtype):
    """`model` with every floating array leaf in `dtype`: what a weight version carries when rollouts sample
    in another dtype than the trainer's parameters (docs/weight_transfer.md, "Dtype"). One jitted cast of
    all leaves, each output laid out exactly as its input (a sharded parameter stays sharded: no gather,
    and on several hosts every process casts its own shards). `model` itself when nothing needs a cast
    (float32 rollouts of float32 parameters cost nothing). Integer leaves are never touched."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"the publish dtype must be a float dtype, got {dtype.name}")
    arrays, static = eqx.partition(model, lambda x: eqx.is_inexact_array(x) and jnp.dtype(x.dtype) != dtype)
    leaves, treedef = jax.tree.flatten(arrays)
    if not leaves:
        return model
    if all(isinstance(x, jax.Array) for x in leaves):
        cast = _caster(dtype.name, tuple(x.sharding for x in leaves))(leaves)
    else:  # host (NumPy) leaves: nothing to keep in place
        cast = [np.asarray(x).astype(dtype) for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, cast), static)


@functools.lru_cache(maxsize=8)
def _caster(dtype_name: str, shardings: tuple):
    """The jitted cast for one model's leaf layouts (compiled once per run, not per publish)."""
    dtype = jnp.dtype(dtype_name)
    return jax.jit(lambda xs: [x.astype(dtype) for x in xs], out_shardings=list(shardings))


def is_fully_addressable(model) -> bool:
    arrays, _ = array_tree(model)
    return all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(arrays))


class ModelSkeleton:
    """What a client needs to rebuild a model: its structure, its static (non-array) fields, and
    each array leaf's name, shape, dtype and placement. Holds no array data.

    Leaves that are `jax.Array`s (or `jax.ShapeDtypeStruct`s with a sharding) in the model given are
    loaded with the same sharding; other array leaves (NumPy) are loaded onto the default device.
    """

    def __init__(self, model):
        arrays, self._static = array_tree(model)
        leaves, self._treedef = jax.tree.flatten(arrays)
        self.names: list[str] = leaf_names(arrays)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [np.dtype(x.dtype) for x in leaves]
        self.shardings = [x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None for x in leaves]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def check(self, names: Sequence[str], shapes: Sequence[tuple], dtypes: Sequence, where: str) -> None:
        """Raises WeightFormatError naming `where` and the first leaf that does not fit."""
        if list(names) != self.names:
            missing = sorted(set(self.names) - set(names))[:3]
            extra = sorted(set(names) - set(self.names))[:3]
            raise WeightFormatError(f"{where}: leaves do not match the model (missing {missing}, unexpected {extra})")
        for name, shape, dtype, want_shape, want_dtype in zip(names, shapes, dtypes, self.shapes, self.dtypes):
            if tuple(shape) != want_shape or np.dtype(dtype) != want_dtype:
                raise WeightFormatError(
                    f"{where}: leaf {name} is {np.dtype(dtype).name}{list(shape)}, the model expects "
                    f"{want_dtype.name}{list(want_shape)}"
                )

    def build(self, names: Sequence[str], arrays: Sequence, where: str):
        """The model with these arrays, placed like the skeleton's leaves; waits until they are there."""
        self.check(names, [a.shape for a in arrays], [a.dtype for a in arrays], where)
        placed = [self._place(a, sharding) for a, sharding in zip(arrays, self.shardings)]
        jax.block_until_ready(placed)
        return eqx.combine(jax.tree.unflatten(self._treedef, placed), self._static)

    @staticmethod
    def _place(array, sharding):
        if sharding is None:
            return jax.device_put(array)
        if isinstance(array, jax.Array):
            return array if array.sharding == sharding else jax.device_put(array, sharding)
        # Works for a sharding over several hosts too: each host copies the slices its devices hold.
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
