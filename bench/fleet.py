"""A pod on one machine: N simulated rollout hosts and the real trainer, over storage that costs what GCS
costs (issue 30; docs/scaling.md, "A fleet of rollout hosts").

    python bench/fleet.py --hosts 64 --steps 8 [--kills K --seed S] [--fanout auto|storage|relay]
                          [--processes P] [--checkpoint_every C] [--trainer worker|model]

`--trainer worker` (the default): the product's `TrainWorker` in a Ray actor's process (its reader and
ingestion thread, replay buffer, batching, Levanter checkpoints of a small Llama, weight server, audit
trail, curriculum client) with `TimedUpdate` for the update's compute; the hosts as threads of `--processes`
Ray actor processes (`HostGroup`), each with the product's `RolloutWriter`, weight client (`build_client`:
the job's fan-out) polled with `PollBackoff`, and `CurriculumClient`; rollout files, weight versions, the
pointer and the audit trail under `simstore://fleet/<run>` whose inner filesystem is gcsfs on the GCS
emulator (a process of its own). `--kills K` SIGKILLs the trainer's or a host process K times on a seeded
schedule (`kill_schedule`) and starts a new one; the audit trail must count 0 lost and 0 duplicated.

`--trainer model`: everything in one process on an in-memory store, the trainer a loop over the real replay
buffer with the update as a model of time (fast: what tests/test_fleet.py checks the planner with).

Simulated, a model of time (named under `simulated` in the JSON): a weight version's size (real bytes,
charged in time and counted in bytes as `--weight_stands_for_mb`); a host's generation (its batch's
response tokens over `--host_tokens_per_s`, times a uniform jitter of ±`--jitter`; response lengths
lognormal around `--response_tokens`, capped at twice it; deterministic tokens) and the trainer's update
(the step's tokens over `--train_tokens_per_s`). Storage is `marinrl.storage.simulated.SimulatedStore`:
every request sleeps `--latency_ms`, then its bytes at `--stream_mb_s` per connection (one process: FIFO on
one shared link of `--total_mb_s` too); a listing costs one request per 1,000 names. Hosts drop the weights
they receive (nothing serves them), so 256 hosts × the version size need not fit in memory.

Prints the machine, a line per step, then one JSON line (the fields docs/scaling.md, "A fleet of rollout hosts", lists).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import math
import os
import pathlib
import random
import resource
import signal
import sys
import tempfile
import threading
import time
import uuid

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine  # noqa: E402

from marinrl.config.curriculum import CurriculumConfig, LessonConfig  # noqa: E402
from marinrl.config.env import EnvConfig  # noqa: E402
from marinrl.config.replay import OffPolicyConfig, ReplayConfig  # noqa: E402
from marinrl.dry_run.fleet import FleetShape, plan_fleet  # noqa: E402
from marinrl.storage.rollouts import RolloutReader, RolloutWriter  # noqa: E402
from marinrl.storage.simulated import RequestStats, SimulatedStore, _Link, label_by_role  # noqa: E402
from marinrl.train.replay.buffer import ReplayBuffer  # noqa: E402
from marinrl.transfer.base import PollBackoff  # noqa: E402
from marinrl.types import Rollout, RolloutBatch, RolloutGroup, RolloutMetadata  # noqa: E402

LESSONS = ("easy", "hard")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups_per_host", type=int, default=2, help="groups each host writes per trainer step")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=128)
    p.add_argument("--response_tokens", type=int, default=384, help="median response length")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--host_tokens_per_s", type=float, default=8_000.0, help="a host's generation speed (model)")
    p.add_argument("--jitter", type=float, default=0.1, help="± fraction on each host's generation time")
    p.add_argument("--train_tokens_per_s", type=float, default=2_000_000.0, help="the trainer's update (model)")
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--latency_ms", type=float, default=30.0, help="added to every storage request")
    p.add_argument("--stream_mb_s", type=float, default=200.0, help="per-connection bandwidth")
    p.add_argument("--total_mb_s", type=float, default=0.0,
                   help="the pod's total storage bandwidth (0: no limit but each stream's)")
    p.add_argument("--weight_mb", type=float, default=2.0,
                   help="a version's real bytes, charged and counted as --weight_stands_for_mb")
    p.add_argument("--weight_stands_for_mb", type=float, default=1_200.0)
    p.add_argument("--pointer_reads_per_s", type=float, default=200.0)
    p.add_argument("--fanout", choices=["auto", "storage", "relay"], default="auto",
                   help="storage: every host reads each version; relay: transfer/relay.py reads it once; auto: the "
                        "job's default for this many hosts (relay from marinrl.config.transfer.RELAY_FROM_HOSTS)")
    p.add_argument("--trainer", choices=["worker", "model"], default="worker",
                   help="worker: the real TrainWorker in a process of its own, hosts in --processes processes, rollout "
                        "files and weights on the GCS emulator; model: everything in one process on an in-memory "
                        "store, the trainer a loop of the replay buffer and a model of time")
    p.add_argument("--processes", type=int, default=0,
                   help="processes the simulated hosts are spread over (--trainer worker; 0: one per 64 hosts, "
                        "at least 2 where there are 2 hosts)")
    p.add_argument("--kills", type=int, default=0,
                   help="SIGKILL the trainer and host processes this many times, on a schedule seeded by --seed")
    p.add_argument("--checkpoint_every", type=int, default=None,
                   help="the trainer's checkpoints (--trainer worker; default: every 2 steps with --kills, else at the "
                        "end only, since the planner does not count checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch_interval_ms", type=float, default=0.0,
                   help="Python's GIL switch interval for the one process (0: Python's 5 ms)")
    p.add_argument("--timeout_s", type=float, default=300.0, help="a trainer step waiting longer fails the run")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- storage


class TimedReader(RolloutReader):
    """The real reader; the bench notes how long each poll took and how many files it returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.polls: list[tuple[float, float, int]] = []  # (end time, seconds, files)

    def read_new_with_paths(self, *a, **kw):
        start = time.perf_counter()
        out = super().read_new_with_paths(*a, **kw)
        self.polls.append((time.perf_counter(), time.perf_counter() - start, len(out)))
        return out


# ----------------------------------------------------------------------------- rollouts (a model of time)


class Generator:
    """A host's deterministic generations: response lengths lognormal around `--response_tokens` (capped at
    twice it), tokens drawn once per host and reused, rewards 0 or 1. The rollouts of a batch are copies
    of the host's templates with the batch's group ids and weight step set (the simulator's own cost stays
    small next to the product's writer, which encodes every batch in full)."""

    def __init__(self, rng: np.random.Generator, args, host: int, incarnation: int = 0):
        self.args, self.host, self.worker = args, host, f"host{host:04d}"
        self.incarnation = incarnation  # a restarted host's group ids differ from its dead predecessor's
        meta = RolloutMetadata(self.worker, 0)
        self.templates = []
        for _ in range(args.groups_per_host):
            prompt = rng.integers(0, args.vocab, args.prompt_tokens)
            group = []
            for _ in range(args.group_size):
                n = int(min(2 * args.response_tokens, max(1, rng.lognormal(np.log(args.response_tokens), 0.3))))
                reward = float(rng.integers(0, 2))
                group.append(Rollout(
                    prompt_tokens=prompt, response_tokens=rng.integers(0, args.vocab, n),
                    response_logprobs=-rng.random(n).astype(np.float32), temperature=1.0,
                    loss_mask=np.ones(n, dtype=bool),
                    token_rewards=np.where(np.arange(n) == n - 1, reward, 0.0).astype(np.float32),
                    episode_reward=reward, finish_reason="stop", env_name="echo", lesson_id=LESSONS[0],
                    group_id="template", metadata=meta))
            self.templates.append(group)
        self.tokens = sum(r.response_tokens.size for g in self.templates for r in g)
        self.batches = 0

    def batch(self, weight_step: int, lesson: str) -> RolloutBatch:
        meta = RolloutMetadata(self.worker, weight_step)
        groups = []
        for g, template in enumerate(self.templates):
            gid = f"h{self.host:04d}-i{self.incarnation}-b{self.batches:06d}-g{g}"
            rollouts = []
            for r in template:
                r = copy.copy(r)
                for name, value in (("group_id", gid), ("lesson_id", lesson), ("metadata", meta)):
                    object.__setattr__(r, name, value)
                rollouts.append(r)
            groups.append(RolloutGroup(tuple(rollouts)))
        self.batches += 1
        return RolloutBatch(tuple(groups), meta)


class Host(threading.Thread):
    """One rollout host: the RolloutWorker's pacing (a batch for trainer step t only with weights
    >= t - max_staleness), generation as a model of time, the product's writer, weight client and
    curriculum client."""

    def __init__(self, index: int, args, rollout_root: str, store, weights_config, curriculum, skeleton, log,
                 relay=None, incarnation: int = 0):
        super().__init__(name=f"host{index}", daemon=True)
        from marinrl.curriculum.actor import CurriculumClient
        from marinrl.transfer.endpoints import build_client

        self.index, self.args, self.log = index, args, log
        self.writer = RolloutWriter(rollout_root, fs=store)
        if relay is not None:
            from marinrl.transfer.relay import RelayWeightClient

            self.client = RelayWeightClient(weights_config, skeleton, relay=relay)
        else:  # the config's fan-out: every host reads storage, or the relay actor
            self.client = build_client(weights_config, skeleton)
        self.curriculum = CurriculumClient(curriculum)
        self.backoff = PollBackoff(args.hosts, args.pointer_reads_per_s, seed=[args.seed, index])
        self.rng = np.random.default_rng([args.seed, index])
        self.generator = Generator(self.rng, args, index, incarnation)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.groups_written = 0
        self.batches = 0

    def run(self):
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the trainer
            self.error = e

    def _run(self):
        args, target, epoch = self.args, None, None
        while not self.stop.is_set():
            start = time.perf_counter()
            update = self.client.poll()
            if update is not None:
                self.log["fetch_s"].append(time.perf_counter() - start)
                self.log["received"][update.weight_step].append((self.index, time.time()))
                self.client.model = None  # nothing serves it here: 256 hosts need not hold 256 copies
                if self.client.version.epoch != epoch:  # a restarted trainer: pace by its steps from here on
                    epoch, target = self.client.version.epoch, None
            w = self.client.weight_step
            if w is None or (target is not None and w < target - args.max_staleness):
                self.client.wait_for_news(self.stop, self.backoff)  # as the rollout worker waits
                continue
            self.backoff.reset()
            # no last batch: as a rollout worker does, a host goes on until the trainer is done, so that a group
            # the trainer took for another step than its host meant, or dropped as stale, is made up for
            target = w if target is None else max(target, w)
            start = batch_start = time.perf_counter()
            lesson = self.curriculum.sample_lesson(int(self.rng.integers(0, 2**31)))
            ms = 1e3 * (time.perf_counter() - start)
            self.log["curriculum_first_ms" if self.batches == 0 else "curriculum_ms"].append(ms)
            self.batches += 1
            batch = self.generator.batch(w, lesson)
            self.stop.wait(self.generator.tokens / args.host_tokens_per_s
                           * self.rng.uniform(1 - args.jitter, 1 + args.jitter))
            start = time.perf_counter()
            self.writer.write(batch)
            self.log["write_s"].append(time.perf_counter() - start)
            self.log["batch_s"].append(time.perf_counter() - batch_start)
            self.groups_written += len(batch.groups)
            self.curriculum.update_from_training(lesson, [r.episode_reward for r in batch.rollouts], w)
            target += 1


class LocalRelay:
    """transfer/relay.py's `WeightRelay` in this process (the simulated store lives here) on an event loop
    of its own, called the way a client calls its actor (`relay.latest.remote()`, an ObjectRef); the
    version's bytes go through Ray's object store for real, but between threads of one process, not
    between nodes. A wait for news is answered before `.remote()` returns (at most `LOCAL_WAIT_S`, so a
    stopped host ends soon)."""

    LOCAL_WAIT_S = 1.0

    def __init__(self, config):
        import asyncio
        import types

        import ray

        from marinrl.transfer.relay import WeightRelay

        self.relay = WeightRelay(config)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="local-relay", daemon=True).start()

        def call(coroutine):
            return ray.put(asyncio.run_coroutine_threadsafe(coroutine, self.loop).result())

        self.latest = types.SimpleNamespace(remote=lambda: call(self.relay.latest()))
        self.newer_than = types.SimpleNamespace(
            remote=lambda version, timeout_s: call(self.relay.newer_than(version, min(timeout_s, self.LOCAL_WAIT_S))))

    def metrics(self) -> dict:
        import asyncio

        return asyncio.run_coroutine_threadsafe(self.relay.metrics(), self.loop).result()


# ----------------------------------------------------------------------------- the run


def curriculum_probe(hosts: list[Host], step_s: float, rounds: int = 4) -> list[float]:
    """Each host's per-batch curriculum calls again (a lesson, waited for and timed; the update, sent),
    `rounds` times at random moments of a step, with the rest of the simulated fleet stopped: the calls'
    latency without the CPU the one process's other threads take (docs/scaling.md)."""
    times: list[float] = []
    lock = threading.Lock()

    def one(h: Host):
        rng = np.random.default_rng([h.index, 99])
        for _ in range(rounds):
            time.sleep(rng.uniform(0, step_s))
            start = time.perf_counter()
            lesson = h.curriculum.sample_lesson(int(rng.integers(0, 2**31)))
            ms = 1e3 * (time.perf_counter() - start)
            h.curriculum.update_from_training(lesson, [0.0, 1.0], 0)
            with lock:
                times.append(ms)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


class OwnProcessProbe:
    """A rollout host's curriculum calls from a process of its own (the bench's driver, which only polls), as
    a pod's host makes them, at jittered moments through the run, the fleet's bursts included: the lesson
    draw (`sample_lesson`, timed as the hosts time theirs) and a waited round trip to the actor (`weights`:
    how long the actor takes to answer amid the fleet's calls; a host's copy of the weights is that old at
    most). The simulated hosts' own latencies add the wait for their process's GIL, shared by 64 threads
    (docs/scaling.md)."""

    def __init__(self, handle, every_s: float = 0.2, seed: int = 0):
        from marinrl.curriculum.actor import CurriculumClient

        self.client = CurriculumClient(handle)
        self.every_s, self.seed = every_s, seed
        self.draw_ms: list[float] = []
        self.round_trip_ms: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="curriculum-probe")
        self.thread.start()

    def _run(self):
        rng = np.random.default_rng([self.seed, 7])
        self.client.sample_lesson(0)  # the first draw waits for the weights, as a host's first does
        while not self.stop.wait(self.every_s * rng.uniform(0.5, 1.5)):
            start = time.perf_counter()
            self.client.sample_lesson(int(rng.integers(0, 2**31)))
            self.draw_ms.append(1e3 * (time.perf_counter() - start))
            start = time.perf_counter()
            self.client.weights()
            self.round_trip_ms.append(1e3 * (time.perf_counter() - start))

    def close(self) -> dict[str, list[float]]:
        self.stop.set()
        self.thread.join(timeout=30)
        return {"draw_ms": self.draw_ms, "round_trip_ms": self.round_trip_ms}


def new_log() -> dict:
    """What a process's simulated hosts note: weights received (step → [(host, time)]), each fetch's and
    write's seconds, each waited curriculum call's milliseconds."""
    return {"received": collections.defaultdict(list), "curriculum_ms": [], "curriculum_first_ms": [],
            "fetch_s": [], "write_s": [], "batch_s": []}


def fanout_times(received: dict, publish_at: dict, hosts) -> list[float]:
    """Per version published at `publish_at[step]` (wall clock), until the last of `hosts` held it (each host's
    first receipt after the publish); versions some host never received are left out."""
    out = []
    for step, published in publish_at.items():
        if step == 0:
            continue
        first: dict[int, float] = {}
        for host, t in received.get(step, ()):
            if t >= published - 1e-3 and host not in first:
                first[host] = t
        if set(first) >= set(hosts):
            out.append(max(first.values()) - published)
    return out


def pointer_to_host_s(received: dict, records: list[dict]) -> list[float]:
    """Per version and host, from the end of the version's publish (its pointer written) until the host held it:
    the planner's fan-out (a host's poll and read, or the relay's poll, its one storage read, the object store)."""
    out = []
    for r in records:
        if not r["published_at"]:
            continue
        written, seen = r["published_at"] + r["publish_s"], set()
        for host, t in received.get(r["step"], ()):
            if t >= written - 1e-3 and host not in seen:
                seen.add(host)
                out.append(t - written)
    return out


def planner_report(shape: FleetShape, hosts: int, step_s: float, idle: float, log: dict, busy_s: float,
                   publish_s: float, fanout_s: float | None = None) -> dict:
    """The planner beside the run: its prediction of the step and the trainer's idle fraction, its parts, the
    same parts measured, and the step and idle fraction it composes from the measured parts (the pipelining
    model checked apart from the parts' costs, which the machine's load moves). `fanout_s`: the measured
    fan-out (`pointer_to_host_s`'s median), where the run has it."""
    plan = plan_fleet(shape, hosts)
    # a step waits for the slowest of `hosts` batches: the expected largest of N draws sits at quantile N/(N+1)
    measured = {"host_s": float(np.quantile(log["batch_s"], hosts / (hosts + 1))),
                "fetch_s": float(np.median(log["fetch_s"])), "busy_s": busy_s}
    if fanout_s is not None:
        measured["fanout_s"] = fanout_s
    composed = plan_fleet(shape, hosts, measured=measured)
    return {"step_s_predicted": round(plan.step_s, 3), "step_s_measured": round(step_s, 3),
            "idle_predicted": round(plan.trainer_idle_fraction, 3), "idle_measured": round(idle, 3),
            "waits": plan.waits,
            "parts_predicted": {"host_s": round(plan.parts_s["generate"] + plan.parts_s["write"], 4),
                                "fetch_s": round(plan.parts_s["host_fetch"], 4),
                                "fanout_s": round(plan.parts_s["fanout"], 4),
                                "busy_s": round(plan.trainer_busy_s, 4), "publish_s": round(plan.parts_s["publish"], 4),
                                "write_s": round(plan.parts_s["write"], 4)},
            "parts_measured": {**{k: round(v, 4) for k, v in measured.items()}, "publish_s": round(publish_s, 4),
                               "write_s": round(float(np.median(log["write_s"])), 4)},
            "step_s_from_measured_parts": round(composed.step_s, 3),
            "idle_from_measured_parts": round(composed.trainer_idle_fraction, 3)}


def pct(xs, q):
    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


def run_one_process(args) -> dict:
    import jax.numpy as jnp
    import ray

    from marinrl.config.transfer import FilesystemTransferConfig
    from marinrl.curriculum.actor import CurriculumClient, curriculum_actor
    from marinrl.train.audit import AuditTrail, audit, new_trainer_id, read_trail
    from marinrl.transfer.checkpoint import FilesystemWeightServer

    run_id = f"fleet-{uuid.uuid4().hex[:8]}"
    stats = RequestStats(label_by_role)
    link = _Link(args.total_mb_s * 1e6 or None)
    opts = {"latency_s": args.latency_ms / 1e3, "stream_bytes_per_s": args.stream_mb_s * 1e6, "stats": stats,
            "link": link, "byte_scale": {"weights": args.weight_stands_for_mb / args.weight_mb}}
    store = SimulatedStore(**opts)
    rollout_root = f"/{run_id}/rollouts"
    weights_config = FilesystemTransferConfig(root=f"simstore://{run_id}/weights", format="packed",
                                              storage_options=opts)
    n_leaves = 4
    leaf = int(args.weight_mb * 1e6 / 2 / n_leaves)
    model = {f"layer{i}": jnp.full((leaf,), i, dtype=jnp.bfloat16) for i in range(n_leaves)}

    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=128 * 1024 * 1024, namespace=run_id)
    try:
        handle = curriculum_actor(CurriculumConfig(lessons=tuple(LessonConfig(n, EnvConfig("echo", {}))
                                                                 for n in LESSONS)),
                                  name="curriculum", namespace=run_id)
        trainer_curriculum = CurriculumClient(handle)
        server = FilesystemWeightServer(weights_config)
        publish_at = {0: time.time()}
        server.publish(model, 0)
        log = new_log()
        relay = LocalRelay(weights_config) if args.fanout == "relay" else None
        hosts = [Host(i, args, rollout_root, store, weights_config, handle, model, log, relay)
                 for i in range(args.hosts)]
        reader = TimedReader(rollout_root, fs=store)
        replay = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=args.max_staleness),
                                           max_files_per_poll=max(64, args.hosts),
                                           timeout_s=args.timeout_s), reader)
        trail_root = f"memory://{run_id}-trained"
        trail = AuditTrail(trail_root, new_trainer_id())
        trail.start(0, None, None)
        n_groups = args.hosts * args.groups_per_host
        steps, staleness, publish_s = [], collections.Counter(), []
        t_start = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu_before = usage.ru_utime + usage.ru_stime
        for h in hosts:
            h.start()
        replay.start()
        for s in range(args.steps):
            before, bytes_before = stats.snapshot()
            polls_before = len(reader.polls)
            t0 = time.perf_counter()
            sample = replay.sample(s, n_groups)
            t1 = time.perf_counter()
            groups = [(g.group.group_id, g.weight_step) for g in sample.groups]
            staleness.update(s - w for _, w in groups)
            tokens = sum(r.prompt_tokens.size + r.response_tokens.size for g in sample.groups
                         for r in g.group.rollouts)
            time.sleep(tokens / args.train_tokens_per_s)  # the update's compute: a model of time
            trail.record(s + 1, groups)
            publish_at[s + 1] = time.time()
            server.publish(model, s + 1)
            publish_s.append(time.time() - publish_at[s + 1])
            trainer_curriculum.set_step(s + 1)
            t2 = time.perf_counter()
            after, bytes_after = stats.snapshot()
            delta = collections.Counter(after)
            delta.subtract(before)
            dbytes = collections.Counter(bytes_after)
            dbytes.subtract(bytes_before)
            polls = reader.polls[polls_before:]
            steps.append({"step": s, "wait_s": t1 - t0, "busy_s": t2 - t1, "step_s": t2 - t0,
                          "ingest_s": sum(p[1] for p in polls if p[2]), "requests": delta, "bytes": dbytes})
            print(f"step {s}: waited {t1 - t0:.3f} s, busy {t2 - t1:.3f} s, "
                  f"{sum(delta.values())} requests", flush=True)
            for h in hosts:
                if h.error is not None:
                    raise RuntimeError(f"{h.name} failed") from h.error
        wall = time.perf_counter() - t_start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = usage.ru_utime + usage.ru_stime - cpu_before
        for h in hosts:
            h.stop.set()
        for h in hosts:
            h.join(30)
        replay.stop()
        reader.close()
        quiet = curriculum_probe(hosts, float(np.median([st["step_s"] for st in steps])))
        for h in hosts:
            h.curriculum.flush()
        counts = audit(read_trail(trail_root), num_steps=args.steps, groups_per_step=n_groups,
                       max_staleness=args.max_staleness)
        replay_metrics = replay.metrics()
    finally:
        if own_ray:
            ray.shutdown()
        else:
            ray.kill(handle, no_restart=True)

    measured = steps[1:] if len(steps) > 2 else steps  # step 0 holds the fleet's start
    k = max(1, min(10, len(measured) // 2))

    def per_step(kind: str, label: str | None = None) -> float:
        return round(float(np.mean([sum(v for (kk, lab), v in st["requests"].items()
                                         if (kk == kind or kind == "*") and (label is None or lab == label))
                                     for st in measured])), 1)

    def total(st) -> int:
        return sum(st["requests"].values())

    def bytes_of(label: str) -> float:
        return round(float(np.mean([sum(v for (_, lab), v in st["bytes"].items() if lab == label)
                                     for st in measured])), 0)

    fanout = fanout_times(log["received"], publish_at, range(args.hosts))
    weight_reads = stats.total(kind="read", label="weights")
    step_s = float(np.median([st["step_s"] for st in measured]))
    idle = sum(st["wait_s"] for st in measured) / sum(st["step_s"] for st in measured)
    shape = dataclasses.replace(FleetShape.from_bench(args), fanout=args.fanout)
    written = sum(h.groups_written for h in hosts)
    return {
        "bench": "fleet", "fanout": args.fanout, "hosts": args.hosts, "steps_trained": counts.steps,
        "groups_lost": counts.groups_lost, "groups_duplicated": counts.groups_duplicated,
        "groups_written": written, "groups_trained": counts.groups_trained,
        "groups_dropped": {k2.split("/")[-1]: v for k2, v in replay_metrics.items()
                           if k2.startswith("replay/dropped_groups/") and v},
        "step_s": {"median": round(step_s, 3), "min": round(min(st["step_s"] for st in measured), 3),
                   "max": round(max(st["step_s"] for st in measured), 3)},
        "ingest_s": {"median": pct([st["ingest_s"] for st in measured], 50),
                     "p95": pct([st["ingest_s"] for st in measured], 95)},
        "trainer_idle_fraction": round(idle, 3),
        "requests_per_step": {"list": per_step("list", "rollouts"), "read": per_step("read", "rollouts"),
                              "write": per_step("write", "rollouts"), "pointer": per_step("*", "pointer"),
                              "weights": per_step("read", "weights") + per_step("write", "weights"),
                              "other": per_step("*", "other")},
        "requests_per_step_first10": round(float(np.mean([total(st) for st in measured[:k]])), 1),
        "requests_per_step_last10": round(float(np.mean([total(st) for st in measured[-k:]])), 1),
        "bytes_per_step": {"rollouts": bytes_of("rollouts"), "weights": bytes_of("weights")},
        "weight_fanout_s": {"median": pct(fanout, 50), "max": pct(fanout, 100)},
        "weight_gcs_reads_per_version": round(weight_reads / len(publish_at), 2),  # the initial version too
        "weight_version_mb": args.weight_mb, "weight_stands_for_mb": args.weight_stands_for_mb,
        "curriculum_call_ms": {"p50": pct(log["curriculum_ms"], 50), "p99": pct(log["curriculum_ms"], 99),
                               "first_call_max": pct(log["curriculum_first_ms"], 100)},
        "curriculum_call_ms_quiet": {"p50": pct(quiet, 50), "p99": pct(quiet, 99)},
        "curriculum_waited_calls_per_batch": round(sum(h.curriculum.waited_calls for h in hosts)
                                                   / max(1, sum(h.batches for h in hosts)), 3),
        "staleness": {str(k2): v for k2, v in sorted(staleness.items())},
        "peak_rss_mb": {"process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)},
        "process_cpu_s_per_step": round(cpu_s / max(1, len(steps)), 2),
        "planner": planner_report(shape, args.hosts, step_s, idle, log,
                                  float(np.median([st["busy_s"] for st in measured])), float(np.median(publish_s[1:]))),
        "wall_s": round(wall, 1),
        "simulated": {"generation": f"response tokens / {args.host_tokens_per_s:g} tokens/s ±{args.jitter:g}",
                      "train_step": f"(prompt + response tokens) / {args.train_tokens_per_s:g} tokens/s",
                      "storage": f"in-memory, +{args.latency_ms:g} ms/request, {args.stream_mb_s:g} MB/s a "
                                 f"stream, {args.total_mb_s or 'no limit':} MB/s in all",
                      "weights": f"{args.weight_mb:g} MB of real bytes a version, charged and counted as "
                                 f"{args.weight_stands_for_mb:g} MB",
                      "one_process": "trainer and hosts share one process (peak RSS is theirs together)",
                      **({"relay": "the relay runs in this process; its object-store reads are local "
                                   "(no node-to-node transfer is simulated)"} if args.fanout == "relay" else {})},
        "config": {k2: v for k2, v in vars(args).items()},
        "machine": machine(),
    }


# ----------------------------------------------------------------------------- the pod: processes on the GCS emulator

FLEET_VOCAB = 512
FLEET_BUCKET = "fleet"


def fleet_model_config():
    """The trainer's small model: a Llama of 53k parameters (the update is a model of time, so its size only
    sets the checkpoint's and a version's real bytes; a version is charged as --weight_stands_for_mb)."""
    from levanter.models.llama import LlamaConfig

    from marinrl.config.model import ModelConfig

    return ModelConfig(model=LlamaConfig(seq_len=1024, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                         num_kv_heads=2), vocab_size=FLEET_VOCAB, seed=0)


def version_bytes(model_config) -> int:
    """A published version's array bytes (bfloat16)."""
    import jax

    from marinrl.models.policy_model import build_model

    model = build_model(model_config, dtype="bfloat16")
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model) if hasattr(x, "dtype")))


EMULATOR_LISTEN_BACKLOG = 4096
"""Connections the emulator's socket queues. Its server (`http.server.HTTPServer`, one request at a time) keeps
Python's default of 5: 256 hosts writing at once overflow it, the kernel drops their SYNs, and each dropped one
costs its client a 1, 3, 7 s retransmit (83,745 drops and writes of 4.6 s at the median in a 256-host run), a
limit of the stand-in, not of GCS. The emulator still answers one request at a time."""
# The emulator also rewrites its whole metadata (every object's, as indented JSON) after each write and delete, to
# persist it; in memory nothing reads it back, and its cost grows with the objects stored: a write took 91 ms with
# 2,900 objects and 3.1 ms without the rewrite (`Emulator` turns it off). GCS's request cost does not grow so.


class Emulator:
    """The GCS emulator (gcp-storage-emulator, in memory) in a process of its own, its listen backlog raised."""

    def __init__(self, workdir: pathlib.Path):
        import socket
        import subprocess
        import urllib.request

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--default-bucket", FLEET_BUCKET,
                "-q"]
        launch = (f"import sys, http.server; http.server.HTTPServer.request_queue_size = {EMULATOR_LISTEN_BACKLOG}; "
                  "from gcp_storage_emulator import storage; "
                  "storage.Storage._write_config_to_file = lambda self: None; "
                  f"from gcp_storage_emulator.__main__ import main; sys.exit(main({args!r}))")
        self.log = workdir / "emulator.log"
        self.proc = subprocess.Popen([sys.executable, "-c", launch], stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b/{FLEET_BUCKET}", timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the GCS emulator did not start (log {self.log})") from None
                time.sleep(0.2)

    def rss_mb(self) -> float:
        import psutil

        try:
            return round(psutil.Process(self.proc.pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            return float("nan")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def pod_storage_options(args, emulator_url: str, weight_scale: float) -> dict:
    """fsspec options of the run's `simstore://` URLs: the GCS emulator behind the bench's latency and
    bandwidth (plain data: they travel to every process; each process counts its own requests)."""
    return {"inner": "gcs", "inner_options": {"endpoint_url": emulator_url, "token": "anon"},
            "latency_s": args.latency_ms / 1e3, "stream_bytes_per_s": args.stream_mb_s * 1e6, "stats": "fleet",
            "labeler": "role", "byte_scale": {"weights": weight_scale}}


def _process_report(log: dict | None = None) -> dict:
    from marinrl.storage.simulated import RequestStats, label_by_role

    requests, nbytes = RequestStats.named("fleet", label_by_role).snapshot()
    out = {"pid": os.getpid(), "requests": requests, "bytes": nbytes,
           "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "cpu_s": sum(os.times()[:2])}
    if log is not None:
        out["log"] = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in log.items()}
    return out


class TimedUpdate:
    """The optimizer step as a model of time: the batch's tokens (non-padding positions) over `tokens_per_s`,
    then the state with its step advanced (the weights as they were): what the TrainWorker checkpoints
    and publishes is its real state."""

    def __init__(self, tokens_per_s: float):
        self.tokens_per_s = tokens_per_s
        self.ended: dict[int, float] = {}  # step → wall time the update ended (its publish starts then)

    def __call__(self, trainer, state, step_input):
        import equinox as eqx
        from levanter.callbacks import StepInfo

        start = time.perf_counter()
        tokens = int((np.asarray(step_input.batch.segment_ids.array) >= 0).sum())
        time.sleep(tokens / self.tokens_per_s)
        state = eqx.tree_at(lambda st: st.step, state, state.step + 1)
        self.ended[int(state.step)] = time.time()
        return StepInfo(state, 0.0, time.perf_counter() - start)


class TrainerProcess:
    """A Ray actor: the real TrainWorker (its reader, replay buffer, batching, checkpoints, weight server,
    audit trail and curriculum client) in a thread of its own, with `TimedUpdate` for the update."""

    def __init__(self, config, curriculum, tokens_per_s: float):
        from marinrl.curriculum.actor import CurriculumClient
        from marinrl.job.plan import build_trainer
        from marinrl.train.worker import TrainWorker

        self.update = TimedUpdate(tokens_per_s)
        self.records: list[dict] = []
        self.error: str | None = None
        self.done = False
        self.reads: list[float] = []  # seconds of each of the reader's polls that returned files
        self._reads_seen = 0
        original = RolloutReader.read_new_with_paths

        def timed(reader, *a, **kw):  # the plan's replay part builds its own reader: its polls are timed in place
            start = time.perf_counter()
            out = original(reader, *a, **kw)
            if out:
                self.reads.append(time.perf_counter() - start)
            return out

        RolloutReader.read_new_with_paths = timed  # this actor's process only
        self.worker = TrainWorker(config, build_trainer(config), curriculum=CurriculumClient(curriculum),
                                  update=self.update, on_step=self._on_step)
        threading.Thread(target=self._run, daemon=True).start()

    def _on_step(self, step: int, m: dict) -> None:
        self.records.append({"step": step, "time": time.time(), "published_at": self.update.ended.get(step),
                             **{k.split("/")[1]: float(m[f"train/{k.split('/')[1]}"])
                                for k in ("train/wait_s", "train/batch_s", "train/update_s", "train/publish_s",
                                          "train/step_s")},
                             "staleness": [step - 1 - w for _, w in m["groups"]],
                             "ingest_s": sum(self.reads[self._reads_seen:])})  # the polls that read its files
        self._reads_seen = len(self.reads)

    def _run(self):
        import traceback

        try:
            self.worker.run()
        except BaseException:  # noqa: BLE001 - reported to the bench
            self.error = traceback.format_exc()
        finally:
            self.done = True

    def progress(self) -> dict:
        return {"step": self.worker.step, "done": self.done, "error": self.error, "records": list(self.records),
                **_process_report()}


class HostGroup:
    """A Ray actor: simulated rollout hosts `indices` as threads of one process, each with the product's
    writer, weight client (the config's fan-out) and curriculum client."""

    def __init__(self, indices, incarnation: int, args, rollout_root: str, options: dict, weights_config,
                 curriculum, model_config):
        from marinrl.models.policy_model import build_model
        from marinrl.storage.simulated import SimulatedStore

        skeleton = build_model(model_config, dtype="bfloat16")
        store = SimulatedStore(**options)
        self.log = new_log()
        self.hosts = [Host(i, args, rollout_root, store, weights_config, curriculum, skeleton, self.log,
                           incarnation=incarnation) for i in indices]
        for h in self.hosts:
            h.start()

    def report(self, log: bool = False) -> dict:
        errors = [f"{h.name}: {h.error!r}" for h in self.hosts if h.error is not None]
        return {**_process_report(self.log if log else None), "errors": errors,
                "batches": sum(h.batches for h in self.hosts),
                "waited_calls": sum(h.curriculum.waited_calls for h in self.hosts),
                "groups_written": sum(h.groups_written for h in self.hosts)}

    def stop(self, timeout_s: float = 60.0) -> int:
        """Stops every host (each ends its current request or wait first); returns how many are still
        running after `timeout_s` in all."""
        for h in self.hosts:
            h.stop.set()
        deadline = time.monotonic() + timeout_s
        for h in self.hosts:
            h.join(max(0.0, deadline - time.monotonic()))
        return sum(h.is_alive() for h in self.hosts)

    def probe(self, step_s: float) -> list[float]:
        """`curriculum_probe` over this process's hosts, the fleet stopped."""
        out = curriculum_probe(self.hosts, step_s)
        for h in self.hosts:
            h.curriculum.flush()
        return out


@dataclasses.dataclass
class PodKill:
    target: str  # "trainer" or "hosts"
    at_step: int
    delay_s: float


def kill_schedule(seed: int, kills: int, steps: int) -> list[PodKill]:
    """`kills` kills alternating from shuffled rounds of (trainer, hosts), as bench/chaos.py draws its targets,
    at steps uniform in [2, steps - 2] (after the live trainer recorded that step), 0–1 s later, sorted."""
    rng = random.Random(seed)
    targets: list[str] = []
    while len(targets) < kills:
        targets += rng.sample(("trainer", "hosts"), 2)
    at = sorted(rng.randint(2, max(2, steps - 2)) for _ in range(kills))
    return [PodKill(t, a, round(rng.uniform(0.0, 1.0), 2)) for t, a in zip(targets[:kills], at)]


def _delta(now: dict, before: dict) -> collections.Counter:
    out = collections.Counter(now)
    out.subtract(before)
    return out


def run_pod(args) -> dict:
    import ray
    from levanter.checkpoint import CheckpointerConfig

    from marinrl.config.batching import BatchingConfig
    from marinrl.config.train_worker import TrainWorkerConfig
    from marinrl.config.transfer import FilesystemTransferConfig
    from marinrl.curriculum.actor import curriculum_actor
    from marinrl.levanter_configs import cpu_trainer_config
    from marinrl.train.audit import audit, lineage, read_trail

    if args.total_mb_s:
        raise SystemExit("--total_mb_s is one process's shared link: use it with --trainer model")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors below, when imported as `fleet`
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="fleet-", dir="/tmp"))
    run_id = f"fleet-{uuid.uuid4().hex[:8]}"
    model_config = fleet_model_config()
    real_version = version_bytes(model_config)
    weight_scale = args.weight_stands_for_mb * 1e6 / real_version
    emulator = Emulator(workdir)
    options = pod_storage_options(args, emulator.url, weight_scale)
    root = f"simstore://{FLEET_BUCKET}/{run_id}"
    fanout = FilesystemTransferConfig(root=f"{root}/weights", fanout=args.fanout).for_fleet(args.hosts).fanout
    weights_config = FilesystemTransferConfig(root=f"{root}/weights", format="packed", storage_options=options,
                                              fanout=fanout)
    n_groups = args.hosts * args.groups_per_host
    config = TrainWorkerConfig(
        rollout_root=f"{root}/rollouts", weights=weights_config, model=model_config,
        trainer=cpu_trainer_config(num_train_steps=args.steps, train_batch_size=n_groups * args.group_size,
                                   id=run_id, log_dir=workdir / "logs",
                                   checkpointer=CheckpointerConfig(base_path=str(workdir / "checkpoints"))),
        replay=ReplayConfig(sampling=OffPolicyConfig(staleness=args.max_staleness),
                            max_files_per_poll=max(64, args.hosts), timeout_s=args.timeout_s),
        batching=BatchingConfig(max_length=args.prompt_tokens + 2 * args.response_tokens, layout="packed"),
        groups_per_step=n_groups, storage_options=options,
        checkpoint_every=args.checkpoint_every if args.checkpoint_every is not None else 2 if args.kills else 0,
        publish_dtype="bfloat16", audit_root=f"{root}/trained")
    processes = args.processes or max(min(2, args.hosts), math.ceil(args.hosts / 64))
    shards = [list(range(args.hosts))[k::processes] for k in range(processes)]
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=256 * 1024 * 1024, namespace=run_id)
    trainer_actor = ray.remote(num_cpus=0, max_restarts=0)(TrainerProcess)
    group_actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(HostGroup)
    plan = kill_schedule(args.seed, args.kills, args.steps)
    kills = {"trainer": 0, "hosts": 0}
    started = time.perf_counter()
    handle = curriculum_actor(CurriculumConfig(lessons=tuple(LessonConfig(n, EnvConfig("echo", {})) for n in LESSONS)),
                              name="curriculum", namespace=run_id)
    trainers, groups, incarnations = [], {}, collections.Counter()
    last: dict[str, dict] = {}  # a process's latest report, by name
    steps: list[dict] = []
    try:
        def start_group(k: int):
            groups[k] = group_actor.remote(shards[k], incarnations[k], args, config.rollout_root, options,
                                           weights_config, handle, model_config)
            incarnations[k] += 1

        trainers.append(trainer_actor.remote(config, handle, args.train_tokens_per_s))
        for k in range(processes):
            start_group(k)
        probe = OwnProcessProbe(handle, seed=args.seed)
        seen, last_progress, prog = 0, time.monotonic(), None
        while True:
            prog = ray.get(trainers[-1].progress.remote(), timeout=120)
            if prog["error"]:
                raise RuntimeError(f"the trainer failed:\n{prog['error']}")
            reports = {f"trainer{len(trainers) - 1}": prog,
                       **{f"hosts{k}.{incarnations[k] - 1}": r
                          for k, r in zip(groups, ray.get([g.report.remote() for g in groups.values()], timeout=120))}}
            for name, r in reports.items():
                if r["errors"] if "errors" in r else False:
                    raise RuntimeError(f"{name}: {r['errors'][:3]}")
            if prog["step"] != seen and prog["records"]:  # a step trained: every process's requests since the last one
                requests, nbytes = collections.Counter(), collections.Counter()
                for name, r in reports.items():
                    requests.update(_delta(r["requests"], last.get(name, {}).get("requests", {})))
                    nbytes.update(_delta(r["bytes"], last.get(name, {}).get("bytes", {})))
                steps.append({"step": prog["step"], "trainer": len(trainers) - 1, "requests": requests,
                              "bytes": nbytes, "time": time.time(),
                              "cpu_s": {name: r["cpu_s"] for name, r in reports.items()}})
                seen, last_progress = prog["step"], time.monotonic()
                rec = prog["records"][-1]
                print(f"step {seen}: {sum(requests.values())} requests; the trainer waited {rec['wait_s']:.2f} s, "
                      f"worked {rec['step_s'] - rec['wait_s']:.2f} s", flush=True)
                last.update(reports)
            if prog["done"]:
                break
            if time.monotonic() - last_progress > args.timeout_s:
                raise RuntimeError(f"no trained step for {args.timeout_s:.0f} s at step {seen} (logs {workdir})")
            if plan and seen >= plan[0].at_step:
                kill = plan.pop(0)
                time.sleep(kill.delay_s)
                if kill.target == "trainer":
                    os.kill(prog["pid"], signal.SIGKILL)
                    trainers.append(trainer_actor.remote(config, handle, args.train_tokens_per_s))
                else:
                    k = random.Random(args.seed + len(plan)).randrange(processes)
                    os.kill(last[f"hosts{k}.{incarnations[k] - 1}"]["pid"], signal.SIGKILL)
                    start_group(k)
                kills[kill.target] += 1
                print(f"SIGKILL {kill.target} at step {seen}", flush=True)
                last_progress = time.monotonic()
            time.sleep(0.1)
        wall = time.perf_counter() - started
        own_process = probe.close()
        # a 256-host process's threads finish their requests slowly on 2 loaded cores: report the stragglers
        stragglers = sum(ray.get([g.stop.remote() for g in groups.values()], timeout=600))
        if stragglers:
            print(f"{stragglers} hosts still running after their stop", flush=True)
        finals = dict(zip(groups, ray.get([g.report.remote(log=True) for g in groups.values()], timeout=120)))
        times = [r["time"] for r in prog["records"]]
        step_median = float(np.median(np.diff(times))) if len(times) > 1 else 1.0
        quiet = [x for xs in ray.get([g.probe.remote(step_median) for g in groups.values()], timeout=300) for x in xs]
        trail = read_trail(config.audit_root, options)
        counts = audit(trail, num_steps=args.steps, groups_per_step=n_groups, max_staleness=args.max_staleness)
        chain = lineage(trail)
        relay_metrics = None
        if fanout == "relay":  # its storage requests are its own process's: it reports them itself
            from marinrl.transfer.relay import relay_name

            relay_metrics = ray.get(ray.get_actor(relay_name(weights_config)).metrics.remote(), timeout=60)
    finally:
        for actor in [*trainers, *groups.values()]:
            ray.kill(actor, no_restart=True)
        if own_ray:
            ray.shutdown()
        else:
            ray.kill(handle, no_restart=True)
            try:
                from marinrl.transfer.relay import relay_name

                ray.kill(ray.get_actor(relay_name(weights_config)), no_restart=True)
            except ValueError:
                pass
        emulator_rss = emulator.rss_mb()
        emulator.close()
    return pod_result(args, locals())


def cpu_per_step(steps: list[dict]) -> dict[str, float]:
    """CPU seconds a step of the trainer's process and of all host processes, over `steps` (the processes
    alive at both ends only)."""
    if len(steps) < 2:
        return {}
    first, end = steps[0]["cpu_s"], steps[-1]["cpu_s"]
    both = [name for name in end if name in first]
    n = len(steps) - 1
    return {"trainer": round(sum(end[k] - first[k] for k in both if k.startswith("trainer")) / n, 2),
            "hosts": round(sum(end[k] - first[k] for k in both if k.startswith("hosts")) / n, 2)}


def pod_result(args, v: dict) -> dict:
    """The JSON line of a `--trainer worker` run (`run_pod`'s locals as `v`)."""
    records = v["prog"]["records"]  # the last trainer incarnation's steps (the whole run without kills)
    measured = records[1:] if len(records) > 2 else records  # its first step holds its start
    if len(records) >= 3:  # a step's period: from the end of the one before (the first two left out)
        periods = np.diff([r["time"] for r in records])[1:]
        waits = np.array([r["wait_s"] for r in records[2:]])
    else:
        periods, waits = np.array([r["step_s"] for r in records]), np.array([r["wait_s"] for r in records])
    step_s, idle = float(np.median(periods)), float(waits.sum() / periods.sum())
    busy = float(np.median(periods - waits))
    logs = [f["log"] for f in v["finals"].values()]
    merged = {k: [x for lg in logs for x in lg[k]]
              for k in ("curriculum_ms", "curriculum_first_ms", "fetch_s", "write_s", "batch_s")}
    received = collections.defaultdict(list)
    for lg in logs:
        for step, xs in lg["received"].items():
            received[int(step)].extend(xs)
    publish_at = {r["step"]: r["published_at"] for r in records if r["published_at"]}
    fanout = fanout_times(received, publish_at, range(args.hosts))
    steps = v["steps"][2:] if len(v["steps"]) > 3 else v["steps"]  # the fleet's start left out
    k = max(1, min(10, len(steps) // 2))

    def per_step(kind: str, label: str | None = None) -> float:
        return round(float(np.mean([sum(n for (kk, lab), n in st["requests"].items()
                                         if (kk == kind or kind == "*") and (label is None or lab == label))
                                     for st in steps])), 1)

    def bytes_of(label: str) -> float:
        return round(float(np.mean([sum(n for (_, lab), n in st["bytes"].items() if lab == label) for st in steps])), 0)

    total = [sum(st["requests"].values()) for st in steps]
    weight_reads = sum(n for st in v["steps"] for (kk, lab), n in st["requests"].items()
                       if kk == "read" and lab == "weights")
    relay = v["relay_metrics"]
    if relay is not None:
        weight_reads += relay["version_reads"]
    versions = len(v["steps"]) + 1 + v["kills"]["trainer"]
    shape = dataclasses.replace(FleetShape.from_bench(args), fanout=v["fanout"])
    counts, chain = v["counts"], v["chain"]
    staleness = collections.Counter(x for r in records for x in r["staleness"])
    parts = {"update_s": float(np.median([r["update_s"] for r in measured])),
             "batch_s": float(np.median([r["batch_s"] for r in measured])),
             "publish_s": float(np.median([r["publish_s"] for r in measured])),
             "fetch_s": pct(merged["fetch_s"], 50), "write_s": pct(merged["write_s"], 50)}
    return {
        "bench": "fleet", "trainer": "worker", "fanout": v["fanout"], "hosts": args.hosts,
        "processes": v["processes"], "kills": v["kills"], "steps_trained": counts.steps,
        "groups_lost": counts.groups_lost, "groups_duplicated": counts.groups_duplicated,
        "groups_trained": counts.groups_trained,
        "groups_written": sum(f["groups_written"] for f in v["finals"].values()),
        "trainer_incarnations": len(v["trail"]), "lineage_broken": chain.broken,
        "step_s": {"median": round(step_s, 3), "min": round(float(np.min(periods)), 3),
                   "max": round(float(np.max(periods)), 3)},
        "trainer_idle_fraction": round(idle, 3),
        "ingest_s": {"median": pct([r["ingest_s"] for r in measured], 50),
                     "p95": pct([r["ingest_s"] for r in measured], 95)},
        "trainer_parts_s": {k2: round(x, 4) if x is not None else None for k2, x in parts.items()},
        "requests_per_step": {"list": per_step("list", "rollouts"), "read": per_step("read", "rollouts"),
                              "write": per_step("write", "rollouts"), "pointer": per_step("*", "pointer"),
                              "weights": per_step("read", "weights") + per_step("write", "weights"),
                              "other": per_step("*", "other")},
        "requests_per_step_first10": round(float(np.mean(total[:k])), 1),
        "requests_per_step_last10": round(float(np.mean(total[-k:])), 1),
        "bytes_per_step": {"rollouts": bytes_of("rollouts"), "weights": bytes_of("weights")},
        "weight_fanout_s": {"median": pct(fanout, 50), "max": pct(fanout, 100)},
        "weight_gcs_reads_per_version": round(weight_reads / versions, 2),
        **({"relay": {"pointer_reads_per_step": round(relay["pointer_reads"] / max(1, counts.steps), 1),
                      "calls_per_step": round(relay["calls"] / max(1, counts.steps), 1),
                      "version_reads": relay["version_reads"], "failures": relay["failures"]}}
           if relay is not None else {}),
        "weight_version_bytes": v["real_version"], "weight_stands_for_mb": args.weight_stands_for_mb,
        "curriculum_call_ms": {"p50": pct(merged["curriculum_ms"], 50), "p99": pct(merged["curriculum_ms"], 99),
                               "first_call_max": pct(merged["curriculum_first_ms"], 100)},
        "curriculum_call_ms_quiet": {"p50": pct(v["quiet"], 50), "p99": pct(v["quiet"], 99)},
        "curriculum_call_ms_own_process": {"p50": pct(v["own_process"]["draw_ms"], 50),
                                           "p99": pct(v["own_process"]["draw_ms"], 99),
                                           "calls": len(v["own_process"]["draw_ms"])},
        "curriculum_round_trip_ms": {"p50": pct(v["own_process"]["round_trip_ms"], 50),
                                     "p99": pct(v["own_process"]["round_trip_ms"], 99)},
        "curriculum_waited_calls_per_batch": round(sum(f["waited_calls"] for f in v["finals"].values())
                                                   / max(1, sum(f["batches"] for f in v["finals"].values())), 3),
        "staleness": {str(k2): n for k2, n in sorted(staleness.items())},
        "peak_rss_mb": {"trainer": v["prog"]["rss_mb"],
                        "host_process_max": max(f["rss_mb"] for f in v["finals"].values()),
                        "emulator": v["emulator_rss"]},
        "cpu_s_per_step": cpu_per_step(steps),
        "planner": planner_report(shape, args.hosts, step_s, idle, merged, busy, parts["publish_s"],
                                  fanout_s=pct(pointer_to_host_s(received, records), 50)),
        "wall_s": round(v["wall"], 1),
        "simulated": {"generation": f"response tokens / {args.host_tokens_per_s:g} tokens/s ±{args.jitter:g}",
                      "train_step": f"the update only: the batch's tokens / {args.train_tokens_per_s:g} tokens/s "
                                    "(bench/fleet.py TimedUpdate); ingest, replay, batching, checkpoints, publish and "
                                    "the audit trail are the real TrainWorker's",
                      "storage": f"the GCS emulator (in memory, a process of its own) behind +{args.latency_ms:g} "
                                 f"ms/request and {args.stream_mb_s:g} MB/s a stream (marinrl.storage.simulated); "
                                 "checkpoints on local disk",
                      "weights": f"a {v['real_version']}-byte bf16 model's versions, charged and counted as "
                                 f"{args.weight_stands_for_mb:g} MB",
                      "requests": "each process counts its own; a killed process's requests since the last "
                                  "trainer step are not counted"},
        "config": {k2: x for k2, x in vars(args).items()},
        "machine": machine(),
    }


def run(args) -> dict:
    from marinrl.config.transfer import FilesystemTransferConfig

    # `auto` as the job decides it for this many hosts
    args.fanout = FilesystemTransferConfig(root="-", fanout=args.fanout).for_fleet(args.hosts).fanout
    return run_pod(args) if args.trainer == "worker" else run_one_process(args)


def main(argv=None) -> int:
    args = parse(argv)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    m = machine()
    print(f"machine: {m['cpu']} ({m['cpus']} CPUs, {m['flags']}), load {m['load_avg']}", flush=True)
    out = run(args)
    print(json.dumps(out))
    return 0 if out["groups_lost"] == 0 and out["groups_duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
