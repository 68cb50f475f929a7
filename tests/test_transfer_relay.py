"""The weight relay's checks (marinrl/transfer/relay.py) against a real local Ray: bytes it relays are held to
the publisher's CRC-32 like bytes read from storage, and a delta chain on a relayed root (`delta: true` with
`fanout: relay`) is never relayed as full weights: each host follows the chain from storage, as without a
relay, while the relay announces its versions."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.transfer.checkpoint import PACKED_NAME
from marinrl.transfer.endpoints import build_client, build_server
from marinrl.transfer.relay import RelayWeightClient, relay_name


@pytest.fixture
def relayed(ray_session, tmp_path):
    """A relayed filesystem root's config, and its server; the relay's actor is killed after the test."""
    made = []

    def make(**kw):
        config = FilesystemTransferConfig(root=f"file://{tmp_path}/weights", format="packed", fanout="relay", **kw)
        made.append((config, build_server(config)))
        return made[-1]

    yield make
    for config, server in made:
        server.close()
        try:
            ray_session.kill(ray_session.get_actor(relay_name(config)), no_restart=True)
        except ValueError:  # never created
            pass


def _relay_metrics(ray_session, config) -> dict:
    return ray_session.get(ray_session.get_actor(relay_name(config)).metrics.remote())


def test_relayed_bytes_that_changed_in_storage_are_refused_by_their_crc(ray_session, relayed, tmp_path):
    config, server = relayed()
    model = {"a": jnp.arange(1000, dtype=jnp.float32)}
    client = build_client(config, model)
    assert isinstance(client, RelayWeightClient)
    server.publish(model, 0)
    (path,) = (tmp_path / "weights").glob(f"*/{PACKED_NAME}")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the last array: same length, a float that decodes fine
    path.write_bytes(bytes(data))
    deadline = time.monotonic() + 60
    while client.failures == 0:  # the relay reads the version once asked; the client then reads its bytes
        assert client.poll() is None and time.monotonic() < deadline, "the changed bytes were not refused"
        time.sleep(0.05)
    assert client.version is None and client.storage_fetches == 0 and client.relay_failures == 0
    assert _relay_metrics(ray_session, config)["version_reads"] == 1


def test_a_delta_chain_on_a_relayed_root_reaches_every_host_from_storage(ray_session, relayed):
    config, server = relayed(delta=True, full_every=10)
    model = {"a": jnp.arange(1000, dtype=jnp.float32), "b": jnp.ones((10, 10), jnp.bfloat16)}
    clients = [build_client(config, model) for _ in range(2)]
    for step in range(3):
        published = {"a": model["a"] + step, "b": model["b"]}  # `b` unchanged: versions 1 and 2 are deltas
        server.publish(published, step)
        for c in clients:
            got = c.wait_for(step, timeout_s=60).model
            for k in published:
                np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(published[k]))
            assert c.storage_fetches == step + 1, "a version of the chain was relayed as full weights"
    assert server.deltas_published == 2
    for c in clients:
        metrics = c.metrics
        assert (metrics["snapshots_loaded"], metrics["deltas_applied"], c.relay_failures) == (1, 2, 0), metrics
    relay = _relay_metrics(ray_session, config)
    assert relay["version_reads"] == 0 and relay["failures"] == 0, relay  # it announced the versions, read none
