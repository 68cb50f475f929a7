"""Delta weight sync: chains of deltas arrive bit for bit (fp32 and bf16, sharded or not) through
packed files on memory://, file:// and the GCS emulator and through a real local Ray; a late
client gets the snapshot and then the deltas; a corrupt, tampered or missing delta is caught (file
CRC or per-array checksum) and never yields wrong weights; the next snapshot repairs the chain."""

from __future__ import annotations

import io
import json
import uuid

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GCS_BUCKET, GCS_OPTIONS
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_transfer import _tiny_llama

from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig
from marinrl.transfer.base import ModelSkeleton, WeightFormatError, WeightPublishError
from marinrl.transfer.checkpoint import DELTA_NAME, PACKED_NAME, SNAPSHOT_REQUEST_PREFIX, _Root
from marinrl.transfer.delta import DeltaPublisher, DeltaReceiver, Link
from marinrl.transfer.delta_encoding import BLOCK_ELEMENTS, apply_array, array_crc, encode_array
from marinrl.transfer.endpoints import build_client, build_server
from marinrl.transfer.packed import read_packed_meta, write_packed


def as_dtype(model, dtype):
    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                    arrays), static)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return as_dtype(_tiny_llama(), jnp.dtype(request.param))


def sparse_step(model, step: int, fraction: float = 0.02, leaves: slice | None = None):
    """The next version after an update that changes about `fraction` of the elements (as a small
    AdamW step leaves most bf16 weights bit-identical), or only the leaves `leaves` selects."""
    arrays, static = eqx.partition(model, eqx.is_array)
    flat, treedef = jax.tree.flatten(arrays)
    chosen = set(range(len(flat))[leaves or slice(None)])
    rng = np.random.default_rng(step)
    out = []
    for i, x in enumerate(flat):
        if i not in chosen:
            out.append(x)
            continue
        host = np.array(x)
        mask = rng.random(host.shape) < fraction
        host = np.where(mask, host + np.asarray(0.25, host.dtype), host).astype(host.dtype)
        out.append(jax.device_put(host, x.sharding))
    return eqx.combine(jax.tree.unflatten(treedef, out), static)


def assert_bits_equal(got, want):
    got_leaves = jax.tree.leaves(eqx.filter(got, eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(want, eqx.is_array))
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape
        g, w = np.asarray(g), np.asarray(w)
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[g.dtype.itemsize]
        np.testing.assert_array_equal(g.view(width), w.view(width))


DELTA_CASES = ["memory", "file", "gs", "ray"]


def _config(request, tmp_path, kind: str, **kw):
    kw.setdefault("full_every", 3)
    if kind == "ray":
        request.getfixturevalue("ray_session")
        return RayTransferConfig(name=f"weights-{uuid.uuid4().hex[:10]}", timeout_s=30, delta=True, **kw)
    if kind == "memory":
        return FilesystemTransferConfig(root=f"memory://weights-{uuid.uuid4().hex[:10]}", delta=True, **kw)
    if kind == "file":
        return FilesystemTransferConfig(root=f"file://{tmp_path}/weights", delta=True, **kw)
    request.getfixturevalue("gcs_emulator")
    return FilesystemTransferConfig(root=f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:10]}", delta=True,
                                    storage_options=dict(GCS_OPTIONS), **kw)


@pytest.fixture(params=DELTA_CASES)
def config(request, tmp_path):
    return _config(request, tmp_path, request.param)


@pytest.fixture(params=["memory", "ray"])
def quick_config(request, tmp_path):
    return _config(request, tmp_path, request.param)


@pytest.fixture
def servers():
    built = []

    def build(config):
        built.append(build_server(config))
        return built[-1]

    yield build
    for server in built:
        server.close()


# ----------------------------------------------------------------------------- end to end


def test_chain_of_deltas_is_bit_exact(config, servers, model):
    server = servers(config)
    client = build_client(config, model)
    full = ModelSkeleton(model).nbytes
    version = model
    kinds = []
    for step in range(7):  # snapshots at 0, 3, 6
        version = sparse_step(version, step) if step else version
        published = server.publish(version, step)
        got, got_step = client.poll()
        assert got_step == step
        assert_bits_equal(got, version)
        kinds.append("snapshot" if published.bytes >= full else "delta")
        if step % 3:
            assert client.metrics["bytes"] < full / 4  # 2% of the elements, 4-byte indices
    assert kinds == ["snapshot", "delta", "delta"] * 2 + ["snapshot"]
    assert server.metrics["deltas_published"] == 4
    assert client.metrics["failures"] == 0 and client.metrics["delta_fallbacks"] == 0
    assert client.metrics["deltas_applied"] == 4 and client.metrics["snapshots_loaded"] == 3


def test_late_client_gets_the_snapshot_then_the_deltas(config, servers, model):
    server = servers(config)
    versions = [model]
    sizes = [server.publish(model, 0).bytes]
    for step in (1, 2):
        versions.append(sparse_step(versions[-1], step))
        sizes.append(server.publish(versions[-1], step).bytes)
    late = build_client(config, model)
    got, step = late.poll()
    assert step == 2
    assert_bits_equal(got, versions[2])
    assert late.metrics["bytes"] == sum(sizes)  # the snapshot and both deltas
    assert (late.metrics["snapshots_loaded"], late.metrics["deltas_applied"]) == (1, 2)
    versions.append(sparse_step(versions[-1], 3, leaves=slice(0, 1)))
    server.publish(versions[-1], 3)  # full_every 3: a snapshot
    versions.append(sparse_step(versions[-1], 4))
    delta_bytes = server.publish(versions[-1], 4).bytes
    got, step = late.poll()  # holds 2, not in the chain [3, 4]: the new snapshot and the delta
    assert step == 4 and late.metrics["bytes"] > delta_bytes
    assert (late.metrics["snapshots_loaded"], late.metrics["deltas_applied"]) == (2, 3)
    assert_bits_equal(got, versions[-1])


def test_skipped_snapshot_forces_a_snapshot_load(quick_config, servers, model):
    server = servers(quick_config)
    client = build_client(quick_config, model)
    versions = [model]
    server.publish(model, 0)
    client.poll()
    for step in range(1, 5):  # the client skips 1..3 (3 was a snapshot)
        versions.append(sparse_step(versions[-1], step))
        last = server.publish(versions[-1], step)
    got, step = client.poll()
    assert step == 4 and client.metrics["bytes"] > ModelSkeleton(model).nbytes > last.bytes
    assert_bits_equal(got, versions[-1])
    versions.append(sparse_step(versions[-1], 5))
    server.publish(versions[-1], 5)
    got, step = client.poll()  # a client that polled the chain gets only the next delta
    assert step == 5 and client.metrics["bytes"] < ModelSkeleton(model).nbytes / 4
    assert_bits_equal(got, versions[-1])


def test_failed_publish_is_skipped_by_the_next_delta(servers, model, tmp_path, request, monkeypatch):
    config = _config(request, tmp_path, "file", full_every=10)
    server = servers(config)
    client = build_client(config, model)
    v1 = sparse_step(model, 1)
    server.publish(model, 0)
    server.publish(v1, 1)
    client.poll()
    monkeypatch.setattr(server._root, "write_pointer", lambda pointer: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(WeightPublishError):
        server.publish(sparse_step(v1, 2), 2)  # written, never committed
    monkeypatch.undo()
    v3 = sparse_step(v1, 3)
    server.publish(v3, 3)  # a delta from 1, the last committed version, not from 2
    got, step = client.poll()
    assert step == 3 and client.metrics["failures"] == 0
    assert_bits_equal(got, v3)


def _pointer(config):
    root = _Root(config)
    return root, json.loads(root.fs.cat_file(root.pointer_path))


def _tamper(config, record: dict) -> None:
    """Rewrites a delta file whole, its pointer entry updated: only the per-array checksum can tell."""
    root, pointer = _pointer(config)
    path = f"{root.path}/{record['version']}/{record['file']}"
    meta, names, arrays = read_packed_meta(root.fs.cat_file(path), path)
    arrays = [np.array(a) for a in arrays]
    val = next(i for i, n in enumerate(names) if n.endswith("#val"))
    arrays[val].reshape(-1)[0] ^= 1  # one bit of one new value
    buf = io.BytesIO()
    nbytes, crc = write_packed(buf, names, arrays, meta)
    root.fs.pipe_file(path, buf.getvalue())
    for entry in pointer["chain"]:
        if entry["version"] == record["version"]:
            entry["bytes"], entry["crc32"] = nbytes, crc
    root.fs.pipe_file(root.pointer_path, json.dumps(pointer).encode())


@pytest.mark.parametrize("damage", ["flipped-byte", "tampered-values", "missing"])
def test_broken_delta_never_gives_wrong_weights(damage, servers, model, tmp_path, request):
    config = _config(request, tmp_path, "memory", full_every=10)
    server = servers(config)
    client = build_client(config, model)
    versions = [model]
    server.publish(model, 0)
    for step in (1, 2):
        versions.append(sparse_step(versions[-1], step))
        server.publish(versions[-1], step)
    client.poll()
    versions.append(sparse_step(versions[-1], 3))
    server.publish(versions[-1], 3)
    versions.append(sparse_step(versions[-1], 4))
    server.publish(versions[-1], 4)
    root, pointer = _pointer(config)
    broken = pointer["chain"][3]  # step 3's delta
    path = f"{root.path}/{broken['version']}/{broken['file']}"
    if damage == "flipped-byte":
        data = bytearray(root.fs.cat_file(path))
        data[len(data) - 8] ^= 0xFF
        root.fs.pipe_file(path, bytes(data))
    elif damage == "tampered-values":
        _tamper(config, broken)
    else:
        root.fs.rm(path)

    assert client.poll() is None  # the delta from 2 fails; so does the chain from the snapshot at 3
    assert client.weight_step == 2 and client.metrics["failures"] == 0
    assert_bits_equal(client.model, versions[2])
    assert client.metrics["delta_fallbacks"] == 1
    assert client.poll() is None and client.metrics["delta_fallbacks"] == 1  # logged and counted once
    assert any(p.rsplit("/", 1)[-1].startswith(SNAPSHOT_REQUEST_PREFIX) for p in root.fs.ls(root.path, detail=False))

    late = build_client(config, model)  # a new client stops before the broken delta too
    assert late.poll().weight_step == 2
    assert_bits_equal(late.model, versions[2])

    versions.append(sparse_step(versions[-1], 5))
    published = server.publish(versions[-1], 5)  # the request makes it a snapshot
    assert published.bytes >= ModelSkeleton(model).nbytes
    got, step = client.poll()
    assert step == 5
    assert_bits_equal(got, versions[-1])
    versions.append(sparse_step(versions[-1], 6))
    assert server.publish(versions[-1], 6).bytes < ModelSkeleton(model).nbytes / 4  # deltas again
    assert client.poll().weight_step == 6
    assert_bits_equal(client.model, versions[-1])


def test_ray_tampered_delta_is_caught_by_the_checksum(servers, model, tmp_path, request, ray_session):
    ray = ray_session
    config = _config(request, tmp_path, "ray", full_every=10)
    server = servers(config)
    client = build_client(config, model)
    v1 = sparse_step(model, 1)
    server.publish(model, 0)
    server.publish(v1, 1)
    # A delta for step 2 whose values are off by one bit, registered with the actor as the newest.
    actor = ray.get_actor(config.name)
    *_, chain = ray.get(actor.latest.remote())
    payload = ray.get(chain[-1][3])
    arrays = [np.array(a) for a in payload["arrays"]]
    val = next(i for i, n in enumerate(payload["names"]) if n.endswith("#val"))
    arrays[val].reshape(-1)[0] ^= 1
    meta = dict(payload["meta"], base=[server.epoch, 1])
    bad = ray.put({**payload, "arrays": arrays, "meta": meta})
    taken, _ = ray.get(actor.publish.remote(server.epoch, 2, [bad], 0, [*chain, (server.epoch, 2, "delta", bad)]))
    assert taken
    got, step = client.poll()
    assert step == 1  # the snapshot and delta 1 verify; delta 2 does not
    assert_bits_equal(got, v1)
    assert ray.get(actor.snapshot_wanted.remote())
    v3 = sparse_step(v1, 3)
    assert server.publish(v3, 3).bytes >= ModelSkeleton(model).nbytes  # asked for: a snapshot
    got, step = client.poll()
    assert step == 3
    assert_bits_equal(got, v3)


def test_sharded_arrays(quick_config, servers, model):
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

    def shard(m):
        arrays, static = eqx.partition(m, eqx.is_array)

        def put(x):
            spec = PartitionSpec("data") if x.ndim and x.shape[0] % 4 == 0 else PartitionSpec()
            return jax.device_put(x, NamedSharding(mesh, spec))

        return eqx.combine(jax.tree.map(put, arrays), static)

    sharded = shard(model)
    server = servers(quick_config)
    client = build_client(quick_config, sharded)
    server.publish(sharded, 0)
    held, _ = client.poll()
    v1 = sparse_step(sharded, 1, leaves=slice(0, 2))  # only the first two leaves change
    server.publish(v1, 1)
    got, step = client.poll()
    assert step == 1
    assert_bits_equal(got, v1)
    got_leaves = jax.tree.leaves(eqx.filter(got, eqx.is_array))
    held_leaves = jax.tree.leaves(eqx.filter(held, eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
    assert any(not w.sharding.is_fully_replicated for w in want_leaves)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert g.sharding == w.sharding
        if i >= 2:
            assert g is held_leaves[i]  # untouched by the delta: the device array is kept


# ----------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("encodings", [("elements", "dense"), ("blocks", "dense"), ("elements", "blocks", "dense")])
def test_encode_apply_round_trip_bits(dtype, encodings):
    rng = np.random.default_rng(0)
    size = (1 << 16) + 5 * BLOCK_ELEMENTS + 7  # two index chunks, a partial last block
    old = rng.standard_normal(size).astype(jnp.dtype(dtype)).reshape(1, -1)
    cases = {"few": [3, 65_600, size - 1], "none": [], "all": list(range(size))}
    for name, positions in cases.items():
        new = old.copy()
        new.reshape(-1)[positions] = new.reshape(-1)[positions] + np.asarray(1, new.dtype)
        new.reshape(-1)[5] = np.asarray(-0.0, new.dtype) if name == "few" else new.reshape(-1)[5]
        encoding, names, data = encode_array("w", old, new, encodings)
        expected = {"none": "same", "all": "dense"}.get(name)
        assert encoding == (expected or encodings[0])
        if encoding == "same":
            continue
        got = apply_array("w", encoding, old, data, BLOCK_ELEMENTS, "test")
        assert got.dtype == new.dtype and got.shape == new.shape
        assert array_crc(got) == array_crc(new)
        np.testing.assert_array_equal(got.view(np.uint8), new.view(np.uint8))


def test_nan_payloads_round_trip():
    old = np.zeros(8, np.float32)
    new = old.copy()
    new.view(np.uint32)[2] = 0x7FC00001  # a NaN with a payload
    new.view(np.uint32)[3] = 0x80000000  # -0.0, equal to 0.0 as a float
    encoding, _, data = encode_array("w", old, new, ("elements", "dense"))
    got = apply_array("w", encoding, old, data, BLOCK_ELEMENTS, "test")
    np.testing.assert_array_equal(got.view(np.uint32), new.view(np.uint32))


def test_receiver_refuses_a_delta_on_the_wrong_base():
    names, shapes, dtypes = ["a"], [(4,)], [np.dtype(np.float32)]
    publisher = DeltaPublisher(full_every=5)
    from marinrl.transfer.base import VersionId

    v = [VersionId(1, s) for s in range(3)]
    arrays = [np.arange(4, dtype=np.float32)]
    encoded = []
    for step in range(3):
        arrays = [arrays[0] + (step > 0)]
        e = publisher.encode(v[step], names, arrays)
        publisher.commit(e)
        encoded.append(e)
    links = [Link(v[i], encoded[i].kind, encoded[i]) for i in range(3)]

    def load(link):
        return link.handle.meta, link.handle.names, link.handle.arrays, link.handle.nbytes

    receiver = DeltaReceiver(names, shapes, dtypes, "test")
    # Delta 2 alone on top of the snapshot: its base is 1, not 0.
    assert receiver.receive([links[0], links[2]], load)[0] == v[0]
    assert v[2] in receiver.broken
    receiver = DeltaReceiver(names, shapes, dtypes, "test")
    version, _, _ = receiver.receive(links, load)
    assert version == v[2]
    np.testing.assert_array_equal(receiver.mirror[0], np.arange(4, dtype=np.float32) + 2)


def test_delta_config_is_checked():
    with pytest.raises(ValueError, match="full_every"):
        FilesystemTransferConfig(root="memory://x", delta=True, full_every=0)
    with pytest.raises(ValueError, match="delta"):
        FilesystemTransferConfig(root="/tmp/x", delta=True, format="tensorstore")
    with pytest.raises(ValueError, match="RayTransferConfig.full_every"):
        RayTransferConfig(delta=True, full_every=-1)
    with pytest.raises(ValueError, match="RayTransferConfig.delta"):
        RayTransferConfig(delta="yes")


def test_old_readers_refuse_a_delta_pointer(servers, model, tmp_path, request):
    """A pointer with a chain says format version 3, which readers of versions 1 and 2 refuse; without
    delta the pointer stays version 1 and its version folder holds weights.bin as before."""
    config = _config(request, tmp_path, "memory")
    server = servers(config)
    server.publish(model, 0)
    server.publish(sparse_step(model, 1), 1)
    root, pointer = _pointer(config)
    assert pointer["format_version"] == 3 and [e["file"] for e in pointer["chain"]] == [PACKED_NAME, DELTA_NAME]
    plain = FilesystemTransferConfig(root=f"memory://weights-{uuid.uuid4().hex[:10]}")
    servers(plain).publish(model, 0)
    _, pointer = _pointer(plain)
    assert pointer["format_version"] == 1 and "chain" not in pointer


# ----------------------------------------------------------------------------- the ulps encoding

ULPS_ENCODINGS = ("elements", "ulps", "dense")


def _with_steps(old: np.ndarray, steps: dict[int, int]) -> np.ndarray:
    """`old` with the raw bits at each position moved by its step (wrapping), e.g. +3 units in the last place."""
    new = old.copy()
    bits = new.reshape(-1).view({2: np.uint16, 4: np.uint32}[old.dtype.itemsize])
    for position, step in steps.items():
        bits[position] += np.array(step).astype(bits.dtype)  # two's complement: wraps as the encoder's diff
    return new


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_ulps_round_trip_bits(dtype):
    """Small steps go as int8 units in the last place and 1-byte gaps (fillers past 255); sign flips,
    NaNs, -0.0 and steps beyond int8 go whole; everything comes back bit for bit."""
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(1)
    size = 3 * (1 << 16) + 11
    old = (rng.standard_normal(size) * 0.02).astype(dt)
    width = {2: np.uint16, 4: np.uint32}[dt.itemsize]
    quiet = range(100_000, 102_000)  # no random changes: the gaps below are exact
    spread = [int(p) for p in rng.choice(size, size // 20, replace=False) if int(p) not in quiet]
    small = {p: int(rng.choice([-3, -2, -1, 1, 2, 3])) for p in spread}
    small.update({0: 127, 100_000: -128, 100_255: 1, 100_511: -1, 101_021: 2, 101_532: 1, size - 1: 5})
    new = _with_steps(old, small)  # gaps 255, 256 (a filler), 510 (a filler), 511 (two fillers)
    whole = [7, 300, 70_000, size - 2]  # escaped: a sign flip, a NaN with a payload, -0.0, a jump of 128
    new[7] = -new[7]
    new.view(width)[300] = {2: 0x7FC1, 4: 0x7FC00001}[dt.itemsize]
    old[70_000], new[70_000] = np.asarray(0.0, dt), np.asarray(-0.0, dt)
    new.view(width)[size - 2] = old.view(width)[size - 2] + width(128)
    positions = np.flatnonzero(old.view(width) != new.view(width))
    fillers = int(((np.diff(positions, prepend=-1) - 1) // 255).sum())
    assert fillers >= 4

    encoding, names, data = encode_array("w", old, new, ULPS_ENCODINGS)
    assert encoding == "ulps" and names == ["w#gap", "w#ulp", "w#val"]
    gaps, steps, val = data
    assert steps.size == positions.size and val.size == len(whole) == int(np.count_nonzero(steps == 0))
    assert gaps.size == positions.size + fillers
    assert sum(a.nbytes for a in data) == gaps.size + steps.size + len(whole) * dt.itemsize
    got = apply_array("w", encoding, old, data, BLOCK_ELEMENTS, "test")
    np.testing.assert_array_equal(got.view(width), new.view(width))
    assert array_crc(got) == array_crc(new)


def test_ulps_is_chosen_after_a_small_step_and_not_for_large_jumps():
    rng = np.random.default_rng(2)
    master = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    old = master.astype(jnp.bfloat16)
    new = (master - 1e-4 * np.sign(rng.standard_normal(master.size))).astype(jnp.bfloat16)  # ~1e-6 relative
    n_changed = int(np.count_nonzero(old.view(np.uint16) != new.view(np.uint16)))
    assert 0.01 < n_changed / master.size < 0.9
    encoding, _, data = encode_array("w", old, new, ULPS_ENCODINGS)
    elements_bytes = n_changed * 4 + 4 * 4  # uint16 offset and bf16 value each, a count per 65,536
    assert encoding == "ulps" and sum(a.nbytes for a in data) < 0.6 * elements_bytes

    jumped = old.copy()
    far = rng.choice(master.size, 100, replace=False)  # sparse: the fillers of 1-byte gaps cost more
    jumped[far] = -jumped[far]  # sign flips: no step fits
    assert encode_array("w", old, jumped, ULPS_ENCODINGS)[0] == "elements"
    assert encode_array("w", old, -old, ULPS_ENCODINGS)[0] == "dense"


@pytest.mark.parametrize("damage", ["past-the-end", "missing-value", "value-dtype"])
def test_apply_refuses_a_malformed_ulps_delta(damage):
    old = np.zeros(300, np.float32)
    new = _with_steps(old, {3: 1, 299: 2})
    new[10] = np.nan
    encoding, _, (gaps, steps, val) = encode_array("w", old, new, ULPS_ENCODINGS)
    assert encoding == "ulps"
    if damage == "past-the-end":
        gaps = np.concatenate([gaps, np.array([5], np.uint8)])
        steps = np.concatenate([steps, np.array([1], np.int8)])
    elif damage == "missing-value":
        val = val[:0]
    else:
        val = val.view(np.int32)
    with pytest.raises(WeightFormatError, match="ulps delta of w"):
        apply_array("w", encoding, old, [gaps, steps, val], BLOCK_ELEMENTS, "test")


def test_receiver_refuses_an_unknown_encoding(caplog):
    names, shapes, dtypes = ["a"], [(4,)], [np.dtype(np.float32)]
    publisher = DeltaPublisher(full_every=5)
    from marinrl.transfer.base import VersionId

    links = []
    for step, arrays in enumerate([np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32) + 1]):
        e = publisher.encode(VersionId(1, step), names, [arrays])
        publisher.commit(e)
        links.append(Link(VersionId(1, step), e.kind, e))
    links[1].handle.meta["arrays"][0]["encoding"] = "zigzag"  # a newer writer's encoding

    def load(link):
        return link.handle.meta, link.handle.names, link.handle.arrays, link.handle.nbytes

    receiver = DeltaReceiver(names, shapes, dtypes, "test")
    assert receiver.receive(links, load)[0] == VersionId(1, 0)  # holds the snapshot, never a guess
    assert VersionId(1, 1) in receiver.broken
    assert "unknown encoding 'zigzag' of a" in caplog.text


def test_a_reader_of_pointer_format_2_refuses_a_delta_pointer(servers, model, tmp_path, request, monkeypatch):
    """Deltas may use `ulps`, which readers of format 2 do not know: they refuse the pointer up front."""
    from marinrl.transfer import checkpoint

    config = _config(request, tmp_path, "memory")
    server = servers(config)
    server.publish(model, 0)
    server.publish(sparse_step(model, 1), 1)
    root, pointer = _pointer(config)
    assert pointer["format_version"] == 3
    monkeypatch.setattr(checkpoint, "POINTER_FORMAT_VERSION", 2)
    with pytest.raises(WeightFormatError, match="pointer format 3 is newer than this reader's"):
        root.read_pointer()


def ulp_step(model, step: int, fraction: float = 0.05):
    """The next version after a small step: `fraction` of the elements move by 1-3 units in the last
    place, and a few change sign or become NaN (escaped)."""
    arrays, static = eqx.partition(model, eqx.is_array)
    flat, treedef = jax.tree.flatten(arrays)
    rng = np.random.default_rng(100 + step)
    out = []
    for x in flat:
        host = np.array(x).reshape(-1)
        width = {2: np.uint16, 4: np.uint32}[host.dtype.itemsize]
        bits = host.view(width)
        moved = np.flatnonzero(rng.random(host.size) < fraction)
        bits[moved] += rng.choice([1, 2, 3, -1, -2, -3], moved.size).astype(width)
        host[moved[:2]] = -host[moved[:2]]
        bits[moved[2:3]] = {2: 0x7FC1, 4: 0x7FC00001}[host.dtype.itemsize]
        out.append(jax.device_put(host.reshape(x.shape), x.sharding))
    return eqx.combine(jax.tree.unflatten(treedef, out), static)


def test_ulp_steps_through_a_chain(quick_config, servers, model):
    server = servers(quick_config)
    client = build_client(quick_config, model)
    versions = [model]
    server.publish(model, 0)
    client.poll()
    for step in (1, 2):
        versions.append(ulp_step(versions[-1], step))
        server.publish(versions[-1], step)
        got, got_step = client.poll()
        assert got_step == step
        assert_bits_equal(got, versions[-1])
    assert client.metrics["delta_fallbacks"] == 0 and client.metrics["failures"] == 0


def test_a_ray_reader_of_delta_payload_format_2_refuses_format_3(servers, model, tmp_path, request, monkeypatch,
                                                                  caplog):
    from marinrl.transfer import ray as ray_transfer

    config = _config(request, tmp_path, "ray")
    server = servers(config)
    client = build_client(config, model)
    server.publish(model, 0)
    monkeypatch.setattr(ray_transfer, "DELTA_PAYLOAD_FORMAT_VERSION", 2)  # the client's code is older
    assert client.poll() is None and client.model is None
    assert client.metrics["failures"] == 1 and "payload format 3" in caplog.text


def _flip_one_bit(arrays: list) -> list[np.ndarray]:
    """Copies of `arrays` with the lowest bit of the first element of the first one flipped."""
    out = [np.array(a) for a in arrays]
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[out[0].dtype.itemsize]
    out[0].reshape(-1).view(width)[0] ^= 1
    return out


@pytest.mark.parametrize("kind", ["file", "ray"])
def test_a_tampered_snapshot_never_gives_wrong_weights(kind, servers, model, tmp_path, request):
    """A snapshot whose values changed after publishing (one bit of one value; on files its file CRC
    and size rewritten to match) is refused: only the per-array checksum DeltaReceiver checks on a
    snapshot can tell, and the Ray transport has no other check. The client keeps what it has, a new
    client gets nothing, and the next scheduled snapshot (`full_every=2`) is exact."""
    config = _config(request, tmp_path, kind, full_every=2)
    server = servers(config)
    client = build_client(config, model)
    v1 = sparse_step(model, 1)
    server.publish(model, 0)
    assert client.poll().weight_step == 0
    server.publish(v1, 1)  # a delta on the snapshot
    if kind == "file":  # the snapshot under the chain, rewritten whole with its pointer entry
        root, pointer = _pointer(config)
        record = pointer["chain"][0]
        path = f"{root.path}/{record['version']}/{record['file']}"
        meta, names, arrays = read_packed_meta(root.fs.cat_file(path), path)
        assert meta["kind"] == "snapshot"
        buf = io.BytesIO()
        nbytes, crc = write_packed(buf, names, _flip_one_bit(arrays), meta)
        root.fs.pipe_file(path, buf.getvalue())
        record["bytes"], record["crc32"] = nbytes, crc
        root.fs.pipe_file(root.pointer_path, json.dumps(pointer).encode())
    else:  # the published snapshot's payload with one bit off, registered as the newest version
        ray = request.getfixturevalue("ray_session")
        actor = ray.get_actor(config.name)
        *_, chain = ray.get(actor.latest.remote())
        snapshot = ray.get(chain[0][3])
        assert snapshot["kind"] == "snapshot"
        bad = ray.put({**snapshot, "arrays": _flip_one_bit(snapshot["arrays"])})
        taken, _ = ray.get(actor.publish.remote(server.epoch, 2, [bad], 0, [(server.epoch, 2, "snapshot", bad)]))
        assert taken

    late = build_client(config, model)  # holds nothing: its only way in is the tampered snapshot
    assert late.poll() is None and late.weight_step is None
    client.poll()  # on files it applies nothing new either (the delta stands on the tampered snapshot)
    assert client.weight_step in (0, 1)
    assert_bits_equal(client.model, v1 if client.weight_step == 1 else model)

    v3 = sparse_step(v1, 3)
    assert server.publish(v3, 3).bytes >= ModelSkeleton(model).nbytes  # the next snapshot
    for c in (client, late):
        got, step = c.poll()
        assert step == 3
        assert_bits_equal(got, v3)
