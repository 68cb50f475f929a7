"""Issue 30, a fleet of rollout hosts: what must not grow faster than the work as hosts are added (pointer
polling, curriculum calls), the fleet bench and the planner checked against it. The rollout reader's
requests per poll are tested in tests/test_storage.py; `marinrl plan` as a user meets it: tests/test_planner.py."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.curriculum.actor import MAX_PENDING_UPDATES, CurriculumClient, curriculum_actor
from marinrl.transfer.base import POINTER_READS_PER_S, WAIT_MAX_INTERVAL_S, PollBackoff

# ----------------------------------------------------------------------------- pointer polling


def _reads_in(hosts: int, wait_s: float, reads_per_s: float) -> int:
    """Pointer reads of `hosts` hosts waiting `wait_s` seconds of modelled time, each with its backoff."""
    reads = 0
    for h in range(hosts):
        backoff, t = PollBackoff(hosts, reads_per_s, seed=h), 0.0
        while t < wait_s:
            reads += 1
            t += backoff.next()
    return reads


@pytest.mark.parametrize("hosts", [1, 8, 64, 256])
def test_a_waiting_fleet_reads_the_pointer_at_a_bounded_rate_however_many_hosts(hosts):
    """Without the fleet cap a host reads every 50 ms: 5,120 reads a second at 256 hosts."""
    wait_s = 120.0
    per_s = _reads_in(hosts, wait_s, POINTER_READS_PER_S) / wait_s
    assert per_s <= 1.15 * min(hosts / WAIT_MAX_INTERVAL_S, POINTER_READS_PER_S)


def test_backoff_is_jittered_so_hosts_that_start_together_spread_out():
    a, b = PollBackoff(64, seed=1), PollBackoff(64, seed=2)
    xs, ys = [a.next() for _ in range(12)], [b.next() for _ in range(12)]
    assert xs != ys and max(xs) <= 1.5 * a.cap_s
    a.reset()
    assert a.next() <= 1.5 * 0.01


def test_backoff_refuses_nonsense():
    with pytest.raises(ValueError, match="fleet_size"):
        PollBackoff(0)


# ----------------------------------------------------------------------------- curriculum calls

ECHO = EnvConfig("echo", {"alphabet_size": 10})


@pytest.fixture
def curriculum(ray_session):
    name = f"fleet-curriculum-{uuid.uuid4().hex[:8]}"
    cfg = CurriculumConfig(lessons=(LessonConfig("a", ECHO), LessonConfig("b", ECHO)))
    handle = curriculum_actor(cfg, name=name, namespace="marinrl-tests")
    yield handle
    ray_session.kill(handle, no_restart=True)


def test_statistics_updates_do_not_wait_and_are_applied_in_order_exactly_once(curriculum):
    """A host sends its updates without waiting for each round trip (at most MAX_PENDING_UPDATES in
    flight); a later call from the same process sees every one applied, in order."""
    client = CurriculumClient(curriculum)
    for step in range(3 * MAX_PENDING_UPDATES):
        client.update_from_training("a", [float(step % 2)] * 4, step)
        assert client.pending <= MAX_PENDING_UPDATES
    assert client.step() == 3 * MAX_PENDING_UPDATES - 1  # the last update's step: all applied before
    other = CurriculumClient(curriculum)
    assert other.metrics() == client.metrics()
    client.flush()
    assert client.pending == 0


def test_a_failed_update_raises_from_the_next_call(curriculum):
    client = CurriculumClient(curriculum)
    client.update_from_training("nope", [1.0], 1)  # an unknown lesson: the actor raises
    with pytest.raises(Exception, match="nope"):
        client.flush()
    client.update_from_training("a", [np.nan], 1)
    with pytest.raises(Exception, match="finite"):
        client.sample_lesson(0)


def test_a_hosts_lesson_draw_waits_only_the_first_time_and_draws_what_the_actor_draws(curriculum, ray_session):
    """`sample_lesson` draws from the client's copy of the weights, refreshed by a call it does not wait
    for: the same lesson the actor would draw with the same seed, one waited call per client in all."""
    client = CurriculumClient(curriculum)
    client.update_from_training("a", [1.0] * 8, 1)  # "a" solved: "b" gets the larger weight
    for seed in range(40):
        assert client.sample_lesson(seed) == ray_session.get(curriculum.sample_lesson.remote(seed))
    assert client.waited_calls == 1


# ----------------------------------------------------------------------------- the fleet bench and the planner

SMALL_FLEET = ["--prompt_tokens", "32", "--response_tokens", "128", "--group_size", "4",
               "--host_tokens_per_s", "2000", "--weight_stands_for_mb", "100", "--latency_ms", "10"]


def _fleet():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import fleet

    return fleet


def test_the_fleet_bench_loses_nothing_and_the_planner_composes_its_measured_parts_into_its_step(ray_session):
    """bench/fleet.py --trainer model at 4 hosts (one process: the product's writer, reader, replay buffer,
    weight server and clients, curriculum actor and audit trail; generation and the update as models of
    time): nothing lost or trained twice, every batch's lesson drawn without waiting after the first. The
    planner is checked in two halves that the machine's load cannot move apart: its costs of the parts
    that storage's modelled latency and bandwidth dominate (a version's publish and a host's fetch, half a
    second each), and its composition of the step from the parts as measured in this run (the
    pipelining), against the step and idle fraction measured."""
    fleet = _fleet()
    out = fleet.run(fleet.parse(["--trainer", "model", "--hosts", "4", "--steps", "6", *SMALL_FLEET]))
    assert out["steps_trained"] == 6 and out["groups_trained"] == 6 * 4 * 2
    assert out["groups_lost"] == 0 and out["groups_duplicated"] == 0 and out["groups_dropped"] == {}
    assert out["requests_per_step"]["read"] == pytest.approx(4, abs=1)  # a read per file, no more
    assert out["weight_gcs_reads_per_version"] <= 4  # every host reads each version once
    assert out["curriculum_waited_calls_per_batch"] <= 1 / 6 + 1e-3  # a host's first draw only
    plan = out["planner"]
    for part in ("publish_s", "fetch_s"):
        assert plan["parts_predicted"][part] == pytest.approx(plan["parts_measured"][part], rel=0.25), part
    assert plan["step_s_from_measured_parts"] == pytest.approx(plan["step_s_measured"], rel=0.25)
    assert plan["idle_from_measured_parts"] == pytest.approx(plan["idle_measured"], rel=0.25)


def test_the_measured_fanout_runs_from_each_publishs_pointer_to_each_hosts_first_receipt():
    """The planner's fan-out (a host's poll and read; with the relay, its poll, storage read and the object store)
    measured from the end of each publish (its pointer written) to each host's first receipt, an earlier
    version's receipts and a host's second receipt left out."""
    fleet = _fleet()
    records = [{"step": 1, "published_at": 100.0, "publish_s": 6.0},
               {"step": 2, "published_at": None, "publish_s": 0.0},
               {"step": 3, "published_at": 200.0, "publish_s": 5.0}]
    received = {1: [(0, 106.5), (1, 107.0), (0, 108.0)], 2: [(0, 150.0)], 3: [(0, 204.0), (1, 205.25)]}
    assert fleet.pointer_to_host_s(received, records) == [0.5, 1.0, 0.25]


@pytest.mark.slow  # 2–3 minutes on 2 loaded cores: four JAX processes start, and the trainer twice
def test_the_pod_bench_runs_the_real_train_worker_on_the_gcs_emulator_and_a_sigkill_loses_nothing(ray_session):
    """bench/fleet.py --trainer worker at 2 hosts (in 2 processes) with one SIGKILL of the trainer's process
    (seed 1 draws it after step 2): the real TrainWorker resumes from its checkpoint, and the audit trail
    counts every step trained, no group lost and none trained twice."""
    fleet = _fleet()
    out = fleet.run(fleet.parse(["--hosts", "2", "--steps", "4", "--kills", "1", "--seed", "1",
                                 "--checkpoint_every", "2", "--weight_stands_for_mb", "20", *SMALL_FLEET[:-4],
                                 "--latency_ms", "10"]))
    assert out["trainer"] == "worker" and out["processes"] == 2
    assert out["kills"] == {"trainer": 1, "hosts": 0} and out["trainer_incarnations"] == 2
    assert out["steps_trained"] == 4 and out["groups_trained"] == 4 * 2 * 2
    assert out["groups_lost"] == 0 and out["groups_duplicated"] == 0 and out["lineage_broken"] is None
    assert 0 < out["weight_gcs_reads_per_version"] <= 2 + 1e-9  # each host reads each version at most once
    assert out["ingest_s"]["median"] > 0  # the trainer's reads of each step's files, 10 ms a request at least
    # a host's curriculum calls from a process of its own, through the run: draws, and the actor's round trips
    assert out["curriculum_call_ms_own_process"]["calls"] > 0 and out["curriculum_round_trip_ms"]["p50"] > 0


def test_the_planner_moves_the_wait_from_the_trainer_to_the_hosts_as_the_fleet_grows():
    from marinrl.dry_run.fleet import FleetShape, plan_fleet, smallest_fleet

    shape = FleetShape(weight_bytes=20e6, train_tokens_per_s=2e5)  # a slow trainer: it waits for few hosts only
    assert plan_fleet(shape, 1).waits == "trainer" and plan_fleet(shape, 256).waits == "rollout hosts"
    n = smallest_fleet(shape)
    assert plan_fleet(shape, n - 1).waits == "trainer" and plan_fleet(shape, n).waits == "rollout hosts"


# ----------------------------------------------------------------------------- weight fan-out


@pytest.mark.parametrize("scheme", ["file", "simstore"])
def test_a_relay_reads_each_version_from_storage_once_whatever_the_number_of_hosts(ray_session, tmp_path, scheme):
    """Eight hosts' clients of a relayed root: each version read from storage once (by the relay), the
    hosts' copies from Ray's object store, equal to what was published. A `simstore://` root opens in the
    relay's own process, which never imports storage/simulated.py itself (storage/fs.py registers it)."""
    import jax
    import jax.numpy as jnp

    from marinrl.config.transfer import FilesystemTransferConfig
    from marinrl.transfer.endpoints import build_client, build_server
    from marinrl.transfer.relay import RelayWeightClient, relay_name

    options = {"inner": "file"} if scheme == "simstore" else {}
    config = FilesystemTransferConfig(root=f"{scheme}://{tmp_path}/weights", format="packed", fanout="relay",
                                      storage_options=options)
    model = {"a": jnp.arange(1000, dtype=jnp.float32), "b": jnp.ones((10, 10), jnp.bfloat16)}
    server = build_server(config)
    clients = [build_client(config, model) for _ in range(8)]
    assert all(isinstance(c, RelayWeightClient) for c in clients)
    try:
        for step in range(3):
            published = jax.tree.map(lambda x, step=step: x + step, model)
            server.publish(published, step)
            for c in clients:
                got = c.wait_for(step, timeout_s=60).model
                for k in published:
                    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(published[k]))
        relay = ray_session.get_actor(relay_name(config))
        metrics = ray_session.get(relay.metrics.remote())
        assert metrics["version_reads"] == 3 and metrics["failures"] == 0
        assert all(c.storage_fetches == 0 and c.relay_failures == 0 for c in clients)
        # a waiting client is told of each version (a long poll), it does not ask every few milliseconds:
        # about two calls a client a version (the poll that finds nothing new, the wait that is answered)
        assert metrics["calls"] <= 4 * len(clients) * 3, metrics
    finally:
        ray_session.kill(ray_session.get_actor(relay_name(config)), no_restart=True)


def test_a_host_waiting_on_the_relay_hears_of_a_version_without_its_backoff_and_stops_when_told(ray_session,
                                                                                                 tmp_path):
    """`wait_for_news` on a relayed client returns when the relay holds a newer version, however long the
    host's backoff (a storage client would sleep it), and at once when its stop flag is set."""
    import threading

    import jax.numpy as jnp

    from marinrl.config.transfer import FilesystemTransferConfig
    from marinrl.transfer.base import PollBackoff
    from marinrl.transfer.endpoints import build_client, build_server
    from marinrl.transfer.relay import relay_name

    config = FilesystemTransferConfig(root=f"file://{tmp_path}/weights", format="packed", fanout="relay")
    model = {"a": jnp.arange(10, dtype=jnp.float32)}
    server, client = build_server(config), build_client(config, model)
    never = PollBackoff(fleet_size=10**9)  # a backoff of hours: only the relay's answer ends the wait
    never._interval = never.cap_s
    try:
        server.publish(model, 0)
        client.wait_for(0, timeout_s=60)
        stop = threading.Event()
        waiter = threading.Thread(target=client.wait_for_news, args=(stop, never))
        waiter.start()
        server.publish({"a": model["a"] + 1}, 1)
        waiter.join(120)
        assert not waiter.is_alive()
        update = client.poll()
        assert update is not None and update.weight_step == 1
        np.testing.assert_array_equal(np.asarray(update.model["a"]), np.arange(10) + 1)
        waiter = threading.Thread(target=client.wait_for_news, args=(stop, never))  # nothing newer to come
        waiter.start()
        stop.set()
        waiter.join(60)
        assert not waiter.is_alive() and client.relay_failures == 0
    finally:
        ray_session.kill(ray_session.get_actor(relay_name(config)), no_restart=True)


def test_auto_fanout_relays_from_the_planners_crossover_on():
    """`fanout: auto` (the default) is `storage` below `RELAY_FROM_HOSTS` rollout hosts and `relay` from it on;
    that constant is the planner's crossover under its stated pod assumptions (docs/scaling.md)."""
    from marinrl.config.job import RLJobConfig
    from marinrl.config.transfer import RELAY_FROM_HOSTS, FilesystemTransferConfig
    from marinrl.dry_run.fleet import FleetShape, plan_fleet, relay_crossover

    assert relay_crossover() == RELAY_FROM_HOSTS
    shape = FleetShape(total_bytes_per_s=25e9, relay_bytes_per_s=3e9)
    for n, better in ((RELAY_FROM_HOSTS - 1, "storage"), (RELAY_FROM_HOSTS, "relay")):
        fetch = {f: plan_fleet(FleetShape(**{**shape.__dict__, "fanout": f}), n).parts_s["fetch"]
                 for f in ("storage", "relay")}
        assert min(fetch, key=fetch.get) == better
    config = FilesystemTransferConfig(root="memory://w")
    assert config.fanout == "auto"
    assert config.for_fleet(RELAY_FROM_HOSTS - 1).fanout == "storage"
    assert config.for_fleet(RELAY_FROM_HOSTS).fanout == "relay"
    assert FilesystemTransferConfig(root="memory://w", fanout="storage").for_fleet(10_000).fanout == "storage"
    assert RLJobConfig().weights_config().fanout == "storage"  # one rollout worker
    with pytest.raises(ValueError, match="fanout"):
        FilesystemTransferConfig(root="memory://w", fanout="tree")
