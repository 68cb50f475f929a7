"""A pod on one machine: N simulated rollout hosts and one trainer in one process, over storage that costs
what GCS costs (issue 30; docs/scaling.md, "A fleet of rollout hosts").

    python bench/fleet.py --hosts 64 --steps 8 [--max_staleness 1] [--weight_mb 2] [--fanout storage|relay]

Real parts, the product's own code: each host's `RolloutWriter` (one Parquet file per host per step), the
trainer's `RolloutReader` + `ReplayBuffer` (its ingestion thread, staleness window, off-policy sampling),
the trainer's `FilesystemWeightServer` and each host's `FilesystemWeightClient` (real packed versions of
`--weight_mb` MB, the pointer polled with `PollBackoff`), the curriculum `CurriculumActor` in a local Ray
(`sample_lesson` per batch, waited for and timed; `update_from_training` sent without waiting; `set_step`
per trainer step) and the audit trail (`train/audit.py`: lost and duplicated groups).

Simulated, a model of time (named under `simulated` in the JSON): a weight version's size (real bytes of
`--weight_mb`, charged in time and counted in bytes as `--weight_stands_for_mb`); a host's generation (its batch's
response tokens over `--host_tokens_per_s`, times a uniform jitter of ±`--jitter`; response lengths
lognormal around `--response_tokens`, capped at twice it; deterministic tokens) and the trainer's update
(the step's prompt + response tokens over `--train_tokens_per_s`). Storage is `marinrl.storage.simulated
.SimulatedStore` over an in-memory store: every request sleeps `--latency_ms`, then its bytes at
`--stream_mb_s` per connection, FIFO on one shared link of `--total_mb_s` (the pod's GCS egress); a
listing costs one request per 1,000 names. Hosts drop the weights they receive (nothing serves them), so
256 hosts × the version size need not fit in memory.

Prints the machine, a line per step, then one JSON line (the fields docs/scaling.md, "A fleet of rollout hosts", lists).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import pathlib
import resource
import sys
import threading
import time
import uuid

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine  # noqa: E402

from marinrl.config.curriculum import CurriculumConfig, LessonConfig  # noqa: E402
from marinrl.config.env import EnvConfig  # noqa: E402
from marinrl.config.replay import ReplayConfig  # noqa: E402
from marinrl.dry_run.fleet import FleetShape, plan_fleet  # noqa: E402
from marinrl.storage.rollouts import RolloutReader, RolloutWriter  # noqa: E402
from marinrl.storage.simulated import RequestStats, SimulatedStore, _Link  # noqa: E402
from marinrl.train.replay.buffer import ReplayBuffer  # noqa: E402
from marinrl.train.replay.sampling import OffPolicyConfig  # noqa: E402
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
    p.add_argument("--fanout", choices=["storage", "relay"], default="storage",
                   help="storage: every host reads each version; relay: transfer/relay.py reads it once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch_interval_ms", type=float, default=0.0,
                   help="Python's GIL switch interval for the one process (0: Python's 5 ms)")
    p.add_argument("--timeout_s", type=float, default=300.0, help="a trainer step waiting longer fails the run")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- storage


def labeler(path: str) -> str:
    if "/rollouts" in path:
        return "rollouts"
    if path.endswith("latest.json"):
        return "pointer"
    if "/weights" in path:
        return "weights"
    return "other"


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

    def __init__(self, rng: np.random.Generator, args, host: int):
        self.args, self.host, self.worker = args, host, f"host{host:04d}"
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

    def batch(self, weight_step: int, lesson: str, target: int) -> RolloutBatch:
        meta = RolloutMetadata(self.worker, weight_step)
        groups = []
        for g, template in enumerate(self.templates):
            gid = f"t{target:05d}-h{self.host:04d}-g{g}"
            rollouts = []
            for r in template:
                r = copy.copy(r)
                for name, value in (("group_id", gid), ("lesson_id", lesson), ("metadata", meta)):
                    object.__setattr__(r, name, value)
                rollouts.append(r)
            groups.append(RolloutGroup(tuple(rollouts)))
        return RolloutBatch(tuple(groups), meta)


class Host(threading.Thread):
    """One rollout host: the RolloutWorker's pacing (a batch for trainer step t only with weights
    >= t - max_staleness), generation as a model of time, the product's writer, weight client and
    curriculum client."""

    def __init__(self, index: int, args, rollout_root: str, store, weights_config, curriculum, skeleton, log,
                 relay=None):
        super().__init__(name=f"host{index}", daemon=True)
        from marinrl.curriculum.actor import CurriculumClient
        from marinrl.transfer.checkpoint import FilesystemWeightClient

        self.index, self.args, self.log = index, args, log
        self.writer = RolloutWriter(rollout_root, fs=store)
        if relay is not None:
            from marinrl.transfer.relay import RelayWeightClient

            self.client = RelayWeightClient(weights_config, skeleton, relay=relay)
        else:
            self.client = FilesystemWeightClient(weights_config, skeleton)
        self.curriculum = CurriculumClient(curriculum)
        self.backoff = PollBackoff(args.hosts, args.pointer_reads_per_s, seed=[args.seed, index])
        self.rng = np.random.default_rng([args.seed, index])
        self.generator = Generator(self.rng, args, index)
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
        args, target = self.args, None
        while not self.stop.is_set():
            update = self.client.poll()
            if update is not None:
                self.log["received"][update.weight_step].append(time.perf_counter())
                self.client.model = None  # nothing serves it here: 256 hosts need not hold 256 copies
            w = self.client.weight_step
            if w is None or (target is not None and w < target - args.max_staleness):
                self.stop.wait(self.backoff.next())
                continue
            self.backoff.reset()
            # no last batch: as a rollout worker does, a host goes on until the trainer is done, so that a group
            # the trainer took for another step than its host meant, or dropped as stale, is made up for
            target = w if target is None else max(target, w)
            start = time.perf_counter()
            lesson = self.curriculum.sample_lesson(int(self.rng.integers(0, 2**31)))
            ms = 1e3 * (time.perf_counter() - start)
            self.log["curriculum_first_ms" if self.batches == 0 else "curriculum_ms"].append(ms)
            self.batches += 1
            batch = self.generator.batch(w, lesson, target)
            self.stop.wait(self.generator.tokens / args.host_tokens_per_s
                           * self.rng.uniform(1 - args.jitter, 1 + args.jitter))
            self.writer.write(batch)
            self.groups_written += len(batch.groups)
            self.curriculum.update_from_training(lesson, [r.episode_reward for r in batch.rollouts], w)
            target += 1


class LocalRelay:
    """transfer/relay.py's `WeightRelay` in this process (the simulated store lives here), called the way
    a client calls its actor (`relay.latest.remote()`, an ObjectRef); the version's bytes go through
    Ray's object store for real, but between threads of one process, not between nodes."""

    def __init__(self, config):
        import types

        import ray

        from marinrl.transfer.relay import WeightRelay

        self.relay = WeightRelay(config)
        self.latest = types.SimpleNamespace(remote=lambda: ray.put(self.relay.latest()))


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


def pct(xs, q):
    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


def run(args) -> dict:
    import jax.numpy as jnp
    import ray

    from marinrl.config.transfer import FilesystemTransferConfig
    from marinrl.curriculum.actor import CurriculumClient, curriculum_actor
    from marinrl.train.audit import AuditTrail, audit, new_trainer_id, read_trail
    from marinrl.transfer.checkpoint import FilesystemWeightServer

    run_id = f"fleet-{uuid.uuid4().hex[:8]}"
    stats = RequestStats(labeler)
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
        publish_at = {0: time.perf_counter()}
        server.publish(model, 0)
        log = {"received": collections.defaultdict(list), "curriculum_ms": [], "curriculum_first_ms": []}
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
        steps, staleness = [], collections.Counter()
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
            publish_at[s + 1] = time.perf_counter()
            server.publish(model, s + 1)
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

    fanout = [max(log["received"][v]) - publish_at[v] for v in range(1, args.steps)
              if len(log["received"][v]) == args.hosts]
    weight_reads = stats.total(kind="read", label="weights")
    step_s = float(np.median([st["step_s"] for st in measured]))
    idle = sum(st["wait_s"] for st in measured) / sum(st["step_s"] for st in measured)
    shape = FleetShape.from_bench(args)
    plan = plan_fleet(shape, args.hosts)
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
        "planner": {"step_s_predicted": round(plan.step_s, 3), "step_s_measured": round(step_s, 3),
                    "idle_predicted": round(plan.trainer_idle_fraction, 3), "idle_measured": round(idle, 3),
                    "waits": plan.waits},
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
