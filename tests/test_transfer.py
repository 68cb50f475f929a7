"""Weight transfer: both modes round-trip a tiny Levanter Llama exactly, return only the newest
version, follow a restarted trainer to a lower step, and survive corrupt or missing data, a killed
coordinator and a half-written version without raising out of poll()."""

from __future__ import annotations

import json
import threading
import time
import uuid
import zlib

import draccus
import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GCS_BUCKET, GCS_OPTIONS
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig, WeightTransferConfig
from marinrl.transfer.base import (
    ModelSkeleton,
    VersionId,
    WeightFormatError,
    WeightPublishError,
    WeightUpdate,
    WeightWaitTimeout,
)
from marinrl.transfer.checkpoint import PACKED_NAME, POINTER_NAME, _Root, version_dir_name
from marinrl.transfer.endpoints import build_client, build_server
from marinrl.transfer.packed import read_packed, write_packed


def _tiny_llama(hidden: int = 32, seed: int = 0):
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel

    config = LlamaConfig(seq_len=32, hidden_dim=hidden, intermediate_dim=2 * hidden, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    vocab = hax.Axis("vocab", 64)
    return eqx.filter_jit(lambda key: LlamaLMHeadModel.init(vocab, config, key=key))(jax.random.PRNGKey(seed))


@pytest.fixture(scope="module")
def model():
    return _tiny_llama()


def shifted(model, k: float):
    """A distinct set of weights of the same structure: every array leaf plus k."""
    arrays, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda x: x + jnp.asarray(k, x.dtype), arrays), static)


def assert_same_model(got, want):
    got_arrays, got_static = eqx.partition(got, eqx.is_array)
    want_arrays, want_static = eqx.partition(want, eqx.is_array)
    assert jax.tree.structure(got_arrays) == jax.tree.structure(want_arrays)
    assert jax.tree.structure(got_static) == jax.tree.structure(want_static)
    assert got_static == want_static
    for g, w in zip(jax.tree.leaves(got_arrays), jax.tree.leaves(want_arrays), strict=True):
        assert isinstance(g, jax.Array)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ----------------------------------------------------------------------------- configurations

FS_CASES = [("memory", "packed"), ("file", "packed"), ("file", "tensorstore"), ("gs", "packed"), ("gs", "tensorstore")]


def _fs_config(request, tmp_path, kind: str, fmt: str, **kw) -> FilesystemTransferConfig:
    if kind == "memory":
        return FilesystemTransferConfig(root=f"memory://weights-{uuid.uuid4().hex[:10]}", format=fmt, **kw)
    if kind == "file":
        return FilesystemTransferConfig(root=f"file://{tmp_path}/weights", format=fmt, **kw)
    request.getfixturevalue("gcs_emulator")
    return FilesystemTransferConfig(root=f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:10]}", format=fmt,
                                    storage_options=dict(GCS_OPTIONS), **kw)


@pytest.fixture(params=FS_CASES, ids=[f"{k}-{f}" for k, f in FS_CASES])
def fs_config(request, tmp_path) -> FilesystemTransferConfig:
    return _fs_config(request, tmp_path, *request.param)


# tensorstore through the emulator takes about a second per version; the round trip covers it.
QUICK_FS_CASES = [case for case in FS_CASES if case != ("gs", "tensorstore")]


@pytest.fixture(params=QUICK_FS_CASES, ids=[f"{k}-{f}" for k, f in QUICK_FS_CASES])
def quick_fs_config(request, tmp_path) -> FilesystemTransferConfig:
    return _fs_config(request, tmp_path, *request.param)


@pytest.fixture(params=[("file", "packed"), ("file", "tensorstore")], ids=["packed", "tensorstore"])
def file_config(request, tmp_path) -> FilesystemTransferConfig:
    return _fs_config(request, tmp_path, *request.param)


@pytest.fixture
def ray_config(ray_session) -> RayTransferConfig:
    return RayTransferConfig(name=f"weights-{uuid.uuid4().hex[:10]}", timeout_s=30)


@pytest.fixture(params=["packed", "tensorstore", "ray"])
def any_config(request, tmp_path):
    """One configuration of each way weights travel: packed (memory://), tensorstore (file://), Ray."""
    if request.param == "ray":
        return request.getfixturevalue("ray_config")
    if request.param == "tensorstore":
        return _fs_config(request, tmp_path, "file", "tensorstore")
    return _fs_config(request, tmp_path, "memory", "packed")


class Servers:
    """Builds servers and closes them at the end of a test (Ray servers kill their coordinator)."""

    def __init__(self):
        self.built = []

    def __call__(self, config):
        server = build_server(config)
        self.built.append(server)
        return server


@pytest.fixture
def servers():
    s = Servers()
    yield s
    for server in s.built:
        server.close()


# ----------------------------------------------------------------------------- both modes


def test_filesystem_round_trip_is_exact(fs_config, servers, model):
    server = servers(fs_config)
    client = build_client(fs_config, model)
    assert client.poll() is None  # nothing published yet: not a failure
    assert client.metrics["failures"] == 0 and client.weight_step is None

    published = server.publish(model, 0)  # the first published weights are the initial model
    assert published.version.weight_step == 0 and published.bytes > 0

    update = client.poll()
    assert isinstance(update, WeightUpdate)
    got, step = update
    assert step == 0 and client.weight_step == 0
    assert_same_model(got, model)
    metrics = client.metrics
    assert metrics["versions_received"] == 1 and metrics["failures"] == 0
    assert metrics["bytes"] >= ModelSkeleton(model).nbytes and metrics["transfer_s"] > 0
    assert client.poll() is None  # nothing newer


def test_ray_round_trip_is_exact(ray_config, servers, model):
    server = servers(ray_config)
    client = build_client(ray_config, model)
    assert client.poll() is None and client.metrics["failures"] == 0
    server.publish(model, 0)
    got, step = client.poll()
    assert step == 0
    assert_same_model(got, model)
    assert client.metrics["bytes"] == ModelSkeleton(model).nbytes
    assert client.poll() is None


def test_poll_returns_only_the_newest(any_config, servers, model):
    server = servers(any_config)
    client = build_client(any_config, model)
    for step in range(3):
        server.publish(shifted(model, step), step)
    got, step = client.poll()
    assert step == 2
    assert_same_model(got, shifted(model, 2))
    assert client.poll() is None
    server.publish(shifted(model, 7), 7)
    got, step = client.poll()
    assert step == 7 and client.metrics["versions_received"] == 2
    assert_same_model(got, shifted(model, 7))


def test_restarted_trainer_lower_step_is_accepted(any_config, servers, model):
    first = servers(any_config)
    client = build_client(any_config, model)
    first.publish(model, 0)
    first.publish(shifted(model, 5), 5)
    assert client.poll().weight_step == 5

    restarted = servers(any_config)  # a new server instance: a later epoch
    assert restarted.epoch > first.epoch
    restarted.publish(shifted(model, 3), 3)
    got, step = client.poll()
    assert step == 3 and client.version.epoch == restarted.epoch
    assert_same_model(got, shifted(model, 3))

    # The superseded server cannot take the run back.
    with pytest.raises(WeightPublishError, match="superseded"):
        first.publish(shifted(model, 6), 6)
    assert client.poll() is None and client.weight_step == 3


def test_one_server_never_publishes_a_lower_step(any_config, servers, model):
    server = servers(any_config)
    server.publish(model, 4)
    for bad in (4, 3, -1, 2.0):
        with pytest.raises(ValueError):
            server.publish(model, bad)


def test_client_loads_onto_the_skeletons_shardings(any_config, servers, model):
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

    def sharding_for(x):
        spec = PartitionSpec("data") if x.ndim and x.shape[0] % 4 == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    arrays, static = eqx.partition(model, eqx.is_array)
    sharded = eqx.combine(jax.tree.map(lambda x: jax.device_put(x, sharding_for(x)), arrays), static)
    server = servers(any_config)
    client = build_client(any_config, sharded)
    server.publish(model, 0)  # published from one device
    got, _ = client.poll()
    assert_same_model(got, model)
    got_leaves = jax.tree.leaves(eqx.filter(got, eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
    assert any(len(w.sharding.device_set) == 4 and not w.sharding.is_fully_replicated for w in want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert g.sharding == w.sharding


def test_abstract_skeleton_is_enough(servers, model, tmp_path, request):
    config = _fs_config(request, tmp_path, "memory", "packed")
    abstract = eqx.filter_eval_shape(lambda: model)
    assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(abstract))
    client = build_client(config, abstract)
    servers(config).publish(model, 0)
    got, _ = client.poll()
    assert_same_model(got, model)


def test_client_with_a_mismatched_skeleton_counts_a_failure(any_config, servers, model):
    server = servers(any_config)
    client = build_client(any_config, _tiny_llama(hidden=16))
    server.publish(model, 0)
    assert client.poll() is None
    assert client.metrics["failures"] == 1 and client.model is None


def test_wait_for(any_config, servers, model):
    server = servers(any_config)
    client = build_client(any_config, model)
    server.publish(model, 0)
    with pytest.raises(WeightWaitTimeout, match="step >= 1"):
        client.wait_for(1, timeout_s=0.2)
    assert client.weight_step == 0  # the poll inside took step 0 on the way

    publisher = threading.Thread(target=lambda: server.publish(shifted(model, 1), 1))
    publisher.start()
    got, step = client.wait_for(1, timeout_s=60)
    publisher.join()
    assert step == 1
    assert_same_model(got, shifted(model, 1))
    # Already held: returns at once with what is held.
    assert client.wait_for(0, timeout_s=0).weight_step == 1


# ----------------------------------------------------------------------------- filesystem mode


def _pointer(config) -> dict:
    root = _Root(config)
    return json.loads(root.fs.cat_file(root.pointer_path))


def _write_raw_pointer(config, data: bytes) -> None:
    root = _Root(config)
    root.fs.pipe_file(root.pointer_path, data)


def test_same_epoch_stale_pointer_is_ignored(quick_fs_config, servers, model):
    server = servers(quick_fs_config)
    client = build_client(quick_fs_config, model)
    server.publish(shifted(model, 1), 1)
    old_pointer = _pointer(quick_fs_config)
    server.publish(shifted(model, 2), 2)
    held, _ = client.poll()

    # An older pointer of the same server reappears (a delayed write, a stale replica): ignored.
    _write_raw_pointer(quick_fs_config, json.dumps(old_pointer).encode())
    assert client.poll() is None
    assert client.weight_step == 2 and client.model is held and client.metrics["failures"] == 0


def test_half_written_version_is_never_read(file_config, servers, model, monkeypatch):
    server = servers(file_config)
    client = build_client(file_config, model)
    server.publish(shifted(model, 1), 1)
    held, _ = client.poll()

    # The trainer dies between writing the version and writing the pointer.
    def crash(pointer):
        raise OSError("simulated crash before the pointer")

    monkeypatch.setattr(server._root, "write_pointer", crash)
    with pytest.raises(WeightPublishError, match=POINTER_NAME):
        server.publish(shifted(model, 2), 2)
    root = _Root(file_config)
    orphan = f"{root.path}/{version_dir_name(VersionId(server.epoch, 2))}"
    assert root.fs.exists(orphan)  # the data is there, complete or not ...
    assert client.poll() is None  # ... but no reader follows it
    assert client.model is held and client.weight_step == 1 and client.metrics["failures"] == 0

    monkeypatch.undo()
    server.publish(shifted(model, 3), 3)
    got, step = client.poll()
    assert step == 3
    assert_same_model(got, shifted(model, 3))
    assert not root.fs.exists(orphan)  # garbage-collected with the old versions


def _corrupt(config, pointer: dict) -> None:
    root = _Root(config)
    folder = f"{root.path}/{pointer['version']}"
    if pointer["format"] == "packed":
        path = f"{folder}/{PACKED_NAME}"
        data = bytearray(root.fs.cat_file(path))
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
        root.fs.pipe_file(path, bytes(data))
        return
    # tensorstore: garbage in place of every chunk of one leaf
    leaf = f"{folder}/embeddings/token_embeddings/weight"
    chunks = [p for p in root.fs.find(leaf) if not p.rsplit("/", 1)[-1].startswith(".")]
    assert chunks
    for chunk in chunks:
        root.fs.pipe_file(chunk, b"\x00garbage")


def test_corrupt_or_missing_data_keeps_the_old_weights(quick_fs_config, servers, model):
    server = servers(quick_fs_config)
    client = build_client(quick_fs_config, model)
    server.publish(shifted(model, 1), 1)
    held, _ = client.poll()

    server.publish(shifted(model, 2), 2)
    _corrupt(quick_fs_config, _pointer(quick_fs_config))
    assert client.poll() is None
    assert client.model is held and client.weight_step == 1 and client.metrics["failures"] == 1

    server.publish(shifted(model, 3), 3)
    root = _Root(quick_fs_config)
    root.fs.rm(f"{root.path}/{_pointer(quick_fs_config)['version']}", recursive=True)
    assert client.poll() is None
    assert client.model is held and client.metrics["failures"] == 2

    _write_raw_pointer(quick_fs_config, b'{"weight_step": 9, "epo')  # a torn pointer
    assert client.poll() is None and client.metrics["failures"] == 3

    server.publish(shifted(model, 4), 4)  # the server overwrites the torn pointer; clients recover
    got, step = client.poll()
    assert step == 4 and client.metrics["failures"] == 3
    assert_same_model(got, shifted(model, 4))


def test_network_errors_are_retried_then_counted(servers, model, tmp_path, request, monkeypatch):
    config = _fs_config(request, tmp_path, "memory", "packed")
    server = servers(config)
    client = build_client(config, model)
    server.publish(shifted(model, 1), 1)
    held, _ = client.poll()
    server.publish(shifted(model, 2), 2)

    calls = []

    def unreachable(path, *args, **kwargs):
        calls.append(path)
        raise ConnectionError("simulated network error")

    monkeypatch.setattr(client._root.fs, "cat_file", unreachable)
    assert client.poll() is None
    assert len(calls) > 1  # retried before giving up
    assert client.model is held and client.metrics["failures"] == 1
    monkeypatch.undo()
    assert client.poll().weight_step == 2


def test_old_versions_are_garbage_collected(tmp_path, request, servers, model):
    config = _fs_config(request, tmp_path, "file", "packed", keep_last=2)
    server = servers(config)
    for step in range(5):
        server.publish(shifted(model, step), step)
    root = _Root(config)
    names = sorted(p.rsplit("/", 1)[-1] for p in root.fs.ls(root.path, detail=False))
    assert names == [POINTER_NAME] + [version_dir_name(VersionId(server.epoch, s)) for s in (3, 4)]
    assert server.metrics["versions_deleted"] == 3
    got, step = build_client(config, model).poll()
    assert step == 4
    assert_same_model(got, shifted(model, 4))


def test_publish_failure_names_the_path(tmp_path, model):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = FilesystemTransferConfig(root=f"file://{blocker}/weights")
    with pytest.raises(WeightPublishError, match=str(blocker)):
        build_server(config).publish(model, 0)


def test_config_is_a_registered_choice():
    fs = draccus.decode(WeightTransferConfig, {"type": "filesystem", "root": "gs://b/w", "keep_last": 3})
    assert isinstance(fs, FilesystemTransferConfig) and fs.keep_last == 3 and fs.format == "auto"
    rc = draccus.decode(WeightTransferConfig, {"type": "ray", "name": "w"})
    assert isinstance(rc, RayTransferConfig) and rc.name == "w"
    with pytest.raises(ValueError, match="tensorstore"):
        FilesystemTransferConfig(root="memory://x", format="tensorstore")
    with pytest.raises(ValueError, match="keep_last"):
        FilesystemTransferConfig(root="memory://x", keep_last=0)
    with pytest.raises(ValueError, match="format"):
        FilesystemTransferConfig(root="memory://x", format="pickle")


# ----------------------------------------------------------------------------- packed format


def _pack(names, arrays) -> tuple[bytes, int, int]:
    import io

    buf = io.BytesIO()
    nbytes, crc = write_packed(buf, names, arrays)
    return buf.getvalue(), nbytes, crc


def test_packed_format_round_trips_every_dtype_and_shape():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.asarray(jnp.ones((3,), jnp.bfloat16) * 1.5),
              np.zeros((0, 4), np.int32), np.asarray(7, np.int64), np.array([True, False])]
    names = [f"leaf{i}" for i in range(len(arrays))]
    data, nbytes, crc = _pack(names, arrays)
    assert nbytes == len(data) and crc == zlib.crc32(data)
    got_names, got = read_packed(data, "mem", expected_bytes=nbytes, expected_crc=crc)
    assert got_names == names
    for g, a in zip(got, arrays):
        assert g.dtype == a.dtype and g.shape == a.shape
        np.testing.assert_array_equal(g, a)


def test_packed_format_rejects_damage():
    data, nbytes, crc = _pack(["w"], [np.arange(100, dtype=np.float32)])
    with pytest.raises(WeightFormatError, match="bytes"):
        read_packed(data[:-1], "f", expected_bytes=nbytes)
    with pytest.raises(WeightFormatError, match="CRC"):
        read_packed(data[:-1] + b"\x01", "f", expected_crc=crc)
    with pytest.raises(WeightFormatError, match="magic"):
        read_packed(b"X" + data[1:], "f")
    with pytest.raises(WeightFormatError, match="does not fit"):
        read_packed(data[:200], "f")


# ----------------------------------------------------------------------------- Ray mode


def test_ray_killed_coordinator_keeps_the_old_weights(ray_config, servers, model, ray_session):
    ray = ray_session
    server = servers(ray_config)
    client = build_client(ray_config, model)
    server.publish(shifted(model, 1), 1)
    held, _ = client.poll()

    ray.kill(ray.get_actor(ray_config.name))
    deadline = time.monotonic() + 30  # ray.kill is asynchronous: wait until the actor is gone (its name freed)
    while True:
        try:
            ray.get_actor(ray_config.name, namespace=ray_config.namespace)
        except ValueError:
            break
        assert time.monotonic() < deadline, "the killed coordinator never went away"
        time.sleep(0.05)
    assert client.poll() is None
    assert client.model is held and client.weight_step == 1 and client.metrics["failures"] == 1
    assert client.poll() is None  # the actor is gone: nothing to fetch, and no new failure
    assert client.metrics["failures"] == 1

    server.publish(shifted(model, 2), 2)  # the server recreates the coordinator
    got, step = client.poll()
    assert step == 2
    assert_same_model(got, shifted(model, 2))


def test_ray_coordinator_refuses_an_older_version(ray_config, servers, model, ray_session):
    server = servers(ray_config)
    server.publish(model, 5)
    actor = ray_session.get_actor(ray_config.name)
    ref = ray_session.put({"format_version": 1, "names": [], "arrays": []})
    taken, held = ray_session.get(actor.publish.remote(server.epoch, 4, [ref], 0))
    assert not taken and held == (server.epoch, 5)
    client = build_client(ray_config, model)
    assert client.poll().weight_step == 5


def _actor_exists(ray, name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def test_ray_trainer_death_then_restart(ray_config, model, ray_session):
    """The trainer runs in its own process, as in a job: its death takes its objects and the
    coordinator with it; clients keep their weights, then follow the restarted trainer down."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Trainer:
        def start(self, config, model, step):
            self.server = build_server(config)
            self.server.publish(model, step)
            return self.server.epoch

    client = build_client(ray_config, model)
    trainer = Trainer.remote()
    ray.get(trainer.start.remote(ray_config, shifted(model, 5), 5))
    held, step = client.poll()
    assert step == 5
    assert_same_model(held, shifted(model, 5))

    ray.kill(trainer)
    # The coordinator dies with its creator, asynchronously: wait (bounded) until its name is gone.
    deadline = time.monotonic() + 30
    while _actor_exists(ray, ray_config.name):
        assert time.monotonic() < deadline, "the coordinator outlived the trainer that created it"
        time.sleep(0.05)
    assert client.poll() is None
    assert client.model is held and client.metrics["failures"] == 1

    restarted = build_server(ray_config)  # the restarted trainer resumes from step 3
    try:
        restarted.publish(shifted(model, 3), 3)
        got, step = client.poll()
        assert step == 3
        assert_same_model(got, shifted(model, 3))
    finally:
        restarted.close()


def _row_config(request, tmp_path, route: str):
    """A configuration of the row `route` of `TRANSPORTS` (the relay's actor killed after the test)."""
    if route == "filesystem":
        return _fs_config(request, tmp_path, "memory", "packed")
    if route == "ray":
        return request.getfixturevalue("ray_config")
    if route == "filesystem/relay":
        from marinrl.transfer.relay import relay_name

        ray = request.getfixturevalue("ray_session")
        config = _fs_config(request, tmp_path, "file", "packed", fanout="relay")

        def kill_relay():
            try:
                ray.kill(ray.get_actor(relay_name(config)), no_restart=True)
            except ValueError:  # never created
                pass

        request.addfinalizer(kill_relay)
        return config
    pytest.fail(f"TRANSPORTS has a row {route!r} this file has no configuration of: add one to _row_config")


def test_every_transfer_type_has_a_transport_and_every_row_carries_weights(request, tmp_path, servers, model):
    """Each row of TRANSPORTS, read from the table itself: a configuration that routes to it builds the row's
    server and client, and a published version reaches the client; every `type:` registered in
    config/transfer.py has a row (transfer/endpoints.py says how to add a transport)."""
    from marinrl.config.transfer import WeightTransferConfig
    from marinrl.transfer.endpoints import TRANSPORTS

    configs = {route: _row_config(request, tmp_path, route) for route in TRANSPORTS}
    registered = {WeightTransferConfig.get_choice_class(name) for name in WeightTransferConfig.get_known_choices()}
    assert registered == {type(c) for c in configs.values()}
    for route, config in configs.items():
        assert config.route == route
        server, client = servers(config), build_client(config, model)
        row = TRANSPORTS[route]
        assert f"{type(server).__module__}:{type(server).__name__}" == row.server
        assert f"{type(client).__module__}:{type(client).__name__}" == row.client
        server.publish(shifted(model, 2), 2)
        got, step = client.wait_for(2, timeout_s=60)
        assert step == 2, route
        assert_same_model(got, shifted(model, 2))
    with pytest.raises(TypeError, match="register it in marinrl.transfer.endpoints.TRANSPORTS"):
        build_server(object())
