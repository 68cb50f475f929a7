"""Where a rollout model lives: a (data, model) mesh over the host's local devices, with the model
tensor-parallel over "model" (Megatron-style: whole key/value heads and MLP columns per device, one
all-reduce after the attention output and one after the MLP) and generation rows over "data".

The axis mapping is haliax's (logical axis name -> mesh axis), as Levanter's own tensor-parallel
inference uses it: `hax.shard(model, ROLLOUT_AXIS_MAPPING)` places the weights, and Levanter's engine
reads the same mapping from `hax.axis_mapping(...)` when it builds its KV cache. Weights that arrive
later (`InferenceServer.reload`, the weight transfer) are put straight onto these shardings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

DATA = "data"
MODEL = "model"

TENSOR_PARALLEL_AXES = ("kv_head", "heads", "mlp")
"""Llama-family logical axes split over the model axis: q/k/v projections by KV head (q_proj's out
axes are (kv_head, q_heads_per_group, head_size), kv_head-major, so "heads" of o_proj splits the same
way), the MLP by its hidden units. The vocabulary joins them when the model axis divides it."""


@dataclasses.dataclass(frozen=True)
class RolloutMesh:
    """The rollout devices and how the model is laid out over them."""

    mesh: Mesh
    """Axes (data, model) over this host's local devices."""
    axis_mapping: dict
    """haliax logical axis -> mesh axis (`hax.shard`, `hax.axis_mapping`)."""

    @property
    def model_axis_size(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def data_axis_size(self) -> int:
        return self.mesh.shape[DATA]

    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*spec))


def _heads_and_mlp(model) -> tuple[int, int, int]:
    cfg = model.config
    return int(cfg.num_heads), int(cfg.num_kv_heads), int(cfg.intermediate_dim)


def check_model_axis_size(size: int, model, n_devices: int, field: str = "inference.model_axis_size") -> None:
    """ValueError naming `field` when `size` cannot split `model` over `n_devices` local devices."""
    heads, kv_heads, mlp = _heads_and_mlp(model)
    if size < 1:
        raise ValueError(f"{field} must be >= 1, got {size}")
    if n_devices % size:
        raise ValueError(f"{field} is {size}, which does not divide this host's {n_devices} local devices "
                         f"({jax.default_backend()}); use a divisor of {n_devices}")
    for what, n in (("num_kv_heads", kv_heads), ("num_heads", heads), ("intermediate_dim", mlp)):
        if n % size:
            raise ValueError(f"{field} is {size}, which does not divide the model's {what} ({n}): each device "
                             f"holds whole key/value heads and an equal share of the MLP; use a divisor of "
                             f"gcd(num_kv_heads, intermediate_dim) = {np.gcd(kv_heads, mlp)}")


DATA_PARALLEL_WEIGHT_SHARE = 0.25
"""A model whose weights take at most this share of one device's memory is sampled data-parallel: every local
device holds the whole model and samples its own rows, with no all-reduce per layer and step. A larger one is
split tensor-parallel, so each device keeps room for its share of the KV cache."""


def choose_model_axis_size(n_devices: int, kv_heads: int, heads: int, mlp: int, weights_bytes: float,
                           device_bytes: Optional[float]) -> int:
    """The default model axis on an accelerator: 1 (all devices data-parallel) when one device holds the model
    with room to spare (`DATA_PARALLEL_WEIGHT_SHARE` of `device_bytes`); else, or where the device's memory is
    unknown, the largest divisor of `n_devices` that splits the heads, KV heads and MLP evenly. The dry run
    (`dry_run.meshes.rollout_model_axis_size`) chooses with the same function."""
    if device_bytes and weights_bytes <= DATA_PARALLEL_WEIGHT_SHARE * device_bytes:
        return 1
    return max(d for d in range(1, n_devices + 1)
               if n_devices % d == 0 and kv_heads % d == 0 and heads % d == 0 and mlp % d == 0)


def default_model_axis_size(model, n_devices: int) -> int:
    """`choose_model_axis_size` for `model` on this host's devices (their allocator's limit). 1 on a CPU: fake
    CPU devices share the same cores."""
    if jax.default_backend() == "cpu":
        return 1
    heads, kv_heads, mlp = _heads_and_mlp(model)
    arrays = [x for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)) if hasattr(x, "nbytes")]
    weights = float(sum(x.nbytes for x in arrays))
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    size = choose_model_axis_size(n_devices, kv_heads, heads, mlp, weights, limit)
    if size == 1 and n_devices > 1:
        logger.info("rollout model: %.2f GiB of weights fit each of the %d local devices: data-parallel sampling "
                    "(no tensor parallelism)", weights / 2**30, n_devices)
    elif size < n_devices:
        logger.warning("rollout model: tensor parallel over %d of %d local devices (num_kv_heads %d, "
                       "intermediate_dim %d); the other factor %d splits generation rows", size, n_devices,
                       kv_heads, mlp, n_devices // size)
    return size


def rollout_mesh(model, model_axis_size: Optional[int]) -> Optional[RolloutMesh]:
    """The mesh a rollout server uses for `model`, or None for no mesh (one device, as on a CPU by
    default, or one accelerator). Raises ValueError naming `inference.model_axis_size` when it cannot split the
    model."""
    devices = jax.local_devices()
    if model_axis_size is None:
        model_axis_size = default_model_axis_size(model, len(devices))
        if model_axis_size == 1 and (jax.default_backend() == "cpu" or len(devices) == 1):
            return None
    check_model_axis_size(model_axis_size, model, len(devices))
    grid = np.asarray(devices).reshape(len(devices) // model_axis_size, model_axis_size)
    mapping = {axis: MODEL for axis in TENSOR_PARALLEL_AXES}
    if model.Vocab.size % model_axis_size == 0:
        mapping["vocab"] = MODEL
    return RolloutMesh(Mesh(grid, (DATA, MODEL)), mapping)


def place(model, where: Optional[RolloutMesh]):
    """`model` on the rollout shardings. A leaf already there (the weight transfer builds leaves with
    the served model's shardings) is kept as it is; any other is copied with one `device_put` to its
    target sharding, each device receiving only its own slice. Without a mesh every leaf is committed
    to the device it is on (no copy): the weight transfer delivers committed arrays, and jit compiles
    anew for a committed argument where it saw an uncommitted one, so the sampler's programs compiled
    with the initial weights (`marinrl/rollout/warmup.py`) would not serve the received ones."""
    if where is None:
        arrays, static = eqx.partition(model, lambda x: isinstance(x, jax.Array))
        committed = jax.tree.map(lambda x: x if x.committed else jax.device_put(x, x.sharding), arrays)
        return eqx.combine(committed, static)
    targets = target_shardings(model, where)
    arrays, static = eqx.partition(model, eqx.is_array)

    def put(x, s):
        if isinstance(x, hax.NamedArray):
            return hax.NamedArray(put(x.array, s), x.axes)
        return x if getattr(x, "sharding", None) == s else jax.device_put(x, s)

    placed = jax.tree.map(put, arrays, targets, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    return eqx.combine(placed, static)


def target_shardings(model, where: RolloutMesh):
    """The NamedSharding of each array of `model`, in the tree of `eqx.filter(model, eqx.is_array)`
    with each NamedArray (not its inner array) standing for one leaf."""
    arrays = eqx.filter(model, eqx.is_array)
    specs = hax.partitioning.pspec_for(arrays, where.axis_mapping, preserve_existing_shardings=False)
    return jax.tree.map(lambda s: NamedSharding(where.mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, PartitionSpec))


@contextlib.contextmanager
def using(where: Optional[RolloutMesh]):
    """The mesh and axis mapping in haliax's context, where Levanter's engine looks for them (it builds
    its KV cache with `named_jit` under the current mapping). Nothing without a mesh."""
    if where is None:
        yield
        return
    with hax.partitioning.set_mesh(where.mesh), hax.axis_mapping(where.axis_mapping):
        yield
