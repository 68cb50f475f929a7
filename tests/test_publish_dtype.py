"""Weight versions in the rollout dtype: the trainer casts its float32 master weights once per publish,
on its own devices and shardings (`cast_for_publish`); every transport carries the bfloat16 arrays as
they are (half the float32 bytes), and the rollout side receives bfloat16 arrays on the served model's
shardings, bit for bit the cast of the master, through full versions and delta chains alike."""

from __future__ import annotations

import uuid

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_transfer import _fs_config, _tiny_llama
from test_transfer_delta import as_dtype, assert_bits_equal

from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig
from marinrl.transfer.base import ModelSkeleton, cast_for_publish, floating_dtypes
from marinrl.transfer.endpoints import build_client, build_server

BF16 = jnp.dtype("bfloat16")


def _placed(model, mesh: Mesh, axis: int):
    """`model` with each array split over the mesh along dimension `axis` where that divides, else replicated."""
    def sharding_for(x):
        spec = [None] * x.ndim
        if x.ndim > axis and x.shape[axis] % mesh.size == 0:
            spec[axis] = mesh.axis_names[0]
        return NamedSharding(mesh, PartitionSpec(*spec))

    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda x: jax.device_put(x, sharding_for(x)), arrays), static)


def _leaves(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


@pytest.fixture(scope="module")
def master():
    """A trainer's float32 weights, sharded over 4 devices along their first dimension (FSDP-like)."""
    return _placed(_tiny_llama(), Mesh(np.array(jax.devices()[:4]), ("fsdp",)), axis=0)


@pytest.fixture(scope="module")
def served(master):
    """The rollout worker's bfloat16 model, split differently (last dimension, another device order)."""
    return _placed(as_dtype(master, BF16), Mesh(np.array(jax.devices()[:4][::-1]), ("model",)), axis=1)


@pytest.fixture(params=["packed", "tensorstore", "ray", "packed-delta", "ray-delta"])
def config(request, tmp_path):
    kind, _, delta = request.param.partition("-")
    if kind == "ray":
        request.getfixturevalue("ray_session")
        return RayTransferConfig(name=f"weights-{uuid.uuid4().hex[:10]}", timeout_s=30, delta=bool(delta))
    if kind == "tensorstore":
        return _fs_config(request, tmp_path, "file", "tensorstore")
    return FilesystemTransferConfig(root=f"memory://weights-{uuid.uuid4().hex[:10]}", delta=bool(delta))


def test_the_publish_cast_keeps_each_arrays_sharding_and_rounds_like_numpy(master):
    cast = cast_for_publish(master, "bfloat16")
    assert floating_dtypes(master) == ["float32"] and floating_dtypes(cast) == ["bfloat16"]
    sharded = 0
    for got, src in zip(_leaves(cast), _leaves(master), strict=True):
        assert got.dtype == BF16 and got.shape == src.shape
        assert got.sharding == src.sharding  # no gather: each device casts its own shard
        sharded += not src.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(src).astype(BF16).view(np.uint16))  # round to nearest even
    assert sharded > 0
    assert cast_for_publish(master, "float32") is master  # nothing to cast: no copy
    with pytest.raises(ValueError, match="float dtype"):
        cast_for_publish(master, "int32")


def test_a_bf16_version_is_half_the_f32_bytes_and_arrives_on_the_served_shardings(config, master, served):
    f32_bytes = ModelSkeleton(master).nbytes
    server = build_server(config)
    try:
        client = build_client(config, served)
        published = server.publish(cast_for_publish(master, "bfloat16"), 0)
        got, step = client.poll()
        assert step == 0
        # Half the float32 bytes, plus at most the packed format's framing: a JSON entry (< 256 bytes) and
        # up to 63 bytes of alignment per leaf, and the 16-byte prefix (a fixed cost: 3.5% of this tiny model).
        n_leaves = len(_leaves(master))
        assert f32_bytes / 2 <= published.bytes <= f32_bytes / 2 + 16 + (256 + 63) * n_leaves, published.bytes
        assert ModelSkeleton(got).nbytes == f32_bytes / 2
        assert client.metrics["bytes"] == published.bytes  # the receiver counts the same bytes
        assert_bits_equal(got, as_dtype(master, BF16))
        for g, want in zip(_leaves(got), _leaves(served), strict=True):
            assert g.dtype == BF16 and g.sharding == want.sharding  # placed where the served model is: no cast
    finally:
        server.close()


def test_bf16_deltas_of_small_f32_updates_round_trip_exactly(master, served, request, tmp_path):
    """Several AdamW-sized steps of the f32 master (most bf16 weights do not move): every version the client
    holds is bit for bit the bf16 cast of its master, most arrive as deltas, and a delta costs less than a
    full bf16 version."""
    config = FilesystemTransferConfig(root=f"memory://weights-{uuid.uuid4().hex[:10]}", delta=True, full_every=10)
    server = build_server(config)
    client = build_client(config, served)
    rng = np.random.default_rng(0)
    current = master
    sizes = []
    try:
        for step in range(4):
            if step:
                arrays, static = eqx.partition(current, eqx.is_array)
                current = eqx.combine(jax.tree.map(
                    lambda x: x - 1e-4 * jnp.asarray(np.sign(rng.standard_normal(x.shape)), x.dtype), arrays), static)
            sizes.append(server.publish(cast_for_publish(current, "bfloat16"), step).bytes)
            got, got_step = client.poll()
            assert got_step == step
            assert_bits_equal(got, as_dtype(current, BF16))
            assert all(g.sharding == w.sharding for g, w in zip(_leaves(got), _leaves(served)))
    finally:
        server.close()
    assert client.metrics["deltas_applied"] == 3 and client.metrics["snapshots_loaded"] == 1
    assert max(sizes[1:]) < sizes[0], sizes


def test_lora_versions_travel_in_the_rollout_dtype_and_merge_into_the_bf16_base():
    """The trainer's f32 adapters, cast once and published; the rollout side's client (its base in bf16)
    expects bf16 adapters, receives them as sent and merges them into W in bf16."""
    from levanter.lora import is_lora_param

    from marinrl.config.lora import LoraRLConfig
    from marinrl.models.lora import AdapterMergingClient, adapter_only, add_adapters, merge_adapters

    lora = LoraRLConfig(rank=2, alpha=4.0)
    base = _tiny_llama()
    trained = add_adapters(base, lora)
    shifted = jax.tree.map(lambda x: x + 0.01, adapter_only(trained))  # B ≠ 0: the merge changes W
    trained = eqx.combine(shifted, trained, is_leaf=is_lora_param)
    config = FilesystemTransferConfig(root=f"memory://weights-{uuid.uuid4().hex[:10]}")
    server = build_server(config)
    client = AdapterMergingClient(config, lora, as_dtype(base, BF16))
    published = cast_for_publish(adapter_only(trained), "bfloat16")
    assert floating_dtypes(published) == ["bfloat16"]
    server.publish(published, 1)
    merged, step = client.poll()
    assert step == 1 and floating_dtypes(client.adapter) == ["bfloat16"] and floating_dtypes(merged) == ["bfloat16"]
    assert_bits_equal(client.adapter, published)
    want = merge_adapters(eqx.combine(published, as_dtype(trained, BF16), is_leaf=is_lora_param))
    assert_bits_equal(merged, want)


def test_the_publish_cast_leaves_integer_and_bool_leaves_as_they_are():
    """A tree with integer leaves (a step counter, token ids, a mask): only the floating ones change dtype."""
    tree = {"w": jnp.ones((2, 3), jnp.float32), "step": jnp.array(7, jnp.int32), "ids": jnp.arange(4, dtype=jnp.int32),
            "mask": jnp.array([True, False]), "host": np.arange(3, dtype=np.int64)}
    cast = cast_for_publish(tree, "bfloat16")
    assert cast["w"].dtype == jnp.bfloat16
    assert {k: cast[k].dtype for k in ("step", "ids", "mask", "host")} == {
        "step": jnp.int32, "ids": jnp.int32, "mask": jnp.bool_, "host": np.int64}
    assert int(cast["step"]) == 7 and cast["ids"].tolist() == [0, 1, 2, 3] and cast["host"] is tree["host"]
