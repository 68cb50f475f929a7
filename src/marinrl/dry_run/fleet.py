"""The fleet planner: one trainer and N rollout hosts talking through object storage, per step, as pure
arithmetic (no JAX, no Ray, no storage): what `marinrl plan` prints and `bench/fleet.py` checks
(docs/planning.md; tests/test_fleet.py holds it to the bench within ±25% on step time and idle fraction).
A job config and the planner's flags become a `FleetShape` in `fleet_inputs.py`.

The model (every figure per trainer step; `FleetShape` names the inputs, `plan_fleet` returns `FleetPlan`):

- a host generates `groups_per_host × group_size` responses at `host_tokens_per_s` (the slowest of N
  hosts, with generation times uniform in ±`jitter`, takes `1 + jitter·(N−1)/(N+1)` times the mean),
  writes one file (one request: latency + bytes over a stream), asks the curriculum for a lesson;
- the trainer reads the step's N files (two listings, then reads `read_concurrency` at a time, each
  a latency plus its bytes over a stream, all of them no faster than the shared link; decoding at
  `decode_rollouts_per_s`), builds the batch (`BATCH_ROLLOUTS_PER_S`), updates (`train_tokens_per_s`, or
  the dry run's FLOPs over a chip's peak × MFU: `trainer_tokens_per_s`), records the step in the audit
  trail (one write), publishes a version (its bytes over one stream plus the pointer's and the clean-up's
  requests); checkpoints are not counted (their cost is the model's, every `checkpoint_every` steps);
- the hosts see it after a pointer read (a waiting host polls every `fleet / pointer_reads_per_s`
  seconds, half that on average) and fetch it: a stream each, N versions through the shared link; with
  the relay, the relay reads the pointer every `RELAY_POLL_S` and tells the waiting hosts at once (their
  calls are open), then they fetch from Ray's object store (only that read holds up a host's generation:
  the hosts go on with the version they hold while the relay reads);
- with `max_staleness = 0` all of that is one chain per step; with `max_staleness >= 1` a host
  generates step t's batch with weights t − 1 while the trainer trains step t − 1, so the period is
  the longest of the hosts' cycle, the trainer's work, and half the loop through both.
"""

from __future__ import annotations

import dataclasses
import math

ROLLOUT_FILE_BYTES_PER_TOKEN = 13.5
"""Parquet bytes per token of a rollout file (token ids, logprobs, masks, rewards), measured with
`bench/fleet.py` (32k vocabulary, 128 + 384 tokens); a group's prompt is stored with each rollout."""
DECODE_ROLLOUTS_PER_S = 45_000.0
"""The trainer's decoding speed of rollout files (bench/storage.py on a 2-core AMD EPYC)."""
BATCH_ROLLOUTS_PER_S = 5_000.0
"""The trainer's building of a step's `TrainingBatch` from sampled groups (packed rows, on the host), rollouts a
second: bench/fleet.py's real TrainWorker measured 0.034 s for 128 rollouts and 0.21 s for 1,024 (512 tokens
each) on a loaded 2-core Xeon (docs/scaling.md)."""
CURRICULUM_CALL_S = 0.002
"""One waited curriculum call (a lesson) through Ray on one machine."""
POINTER_REQUESTS_PER_PUBLISH = 5
"""A publish's requests besides the version's bytes: the pointer read and written, listing and deleting
the oldest version, the snapshot-request listing."""
RELAY_POLL_S = 0.05
"""How often the relay reads the pointer (transfer/relay.py)."""
POD_STORAGE_BYTES_PER_S = 25e9
"""An assumption for `relay_crossover`: the pod's total read bandwidth from its bucket, 200 Gbit/s (the order of
GCS's default per-project, per-region egress quota; check the quota of the project you run in)."""
HOST_OBJECT_STORE_BYTES_PER_S = 3e9
"""An assumption for `relay_crossover`: what one host pulls from another's Ray object store, 3 GB/s (a 25 Gbit/s
host network)."""
INGEST_TAIL_POLLS = 1.5
"""Polls of the trainer's reader between the last file and the batch (it lists every 10–100 ms while it
waits, then reads)."""


@dataclasses.dataclass(frozen=True)
class FleetShape:
    groups_per_host: int = 2
    group_size: int = 8
    prompt_tokens: int = 128
    response_tokens: int = 384
    host_tokens_per_s: float = 8_000.0
    jitter: float = 0.1
    train_tokens_per_s: float = 2_000_000.0
    max_staleness: int = 1
    latency_s: float = 0.03
    stream_bytes_per_s: float = 200e6
    total_bytes_per_s: float | None = None
    weight_bytes: float = 1.2e9
    pointer_reads_per_s: float = 200.0
    read_concurrency: int = 16
    file_bytes_per_token: float = ROLLOUT_FILE_BYTES_PER_TOKEN
    decode_rollouts_per_s: float = DECODE_ROLLOUTS_PER_S
    weight_streams: int = 1
    """Streams a version is written and each host reads it with (1: one packed object; a sharded
    tensorstore version moves over many)."""
    fanout: str = "storage"
    """storage: every host reads each version from storage; relay: one read per version, then each host
    from Ray's object store (transfer/relay.py) at `relay_bytes_per_s` a host (None: free, one machine)."""
    relay_bytes_per_s: float | None = None
    groups_per_step: int | None = None
    """A job's groups per trainer step, shared by the hosts (each generates `groups_per_host`, its share
    rounded up); None: every host writes `groups_per_host` a step (the bench's fleet shape)."""

    @classmethod
    def from_bench(cls, args) -> FleetShape:
        """The shape of a `bench/fleet.py` run (its argparse namespace)."""
        return cls(groups_per_host=args.groups_per_host, group_size=args.group_size,
                   prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
                   host_tokens_per_s=args.host_tokens_per_s, jitter=args.jitter,
                   train_tokens_per_s=args.train_tokens_per_s, max_staleness=args.max_staleness,
                   latency_s=args.latency_ms / 1e3, stream_bytes_per_s=args.stream_mb_s * 1e6,
                   total_bytes_per_s=args.total_mb_s * 1e6 or None, weight_bytes=args.weight_stands_for_mb * 1e6,
                   pointer_reads_per_s=args.pointer_reads_per_s, fanout=getattr(args, "fanout", "storage"))


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    hosts: int
    groups_per_host: int
    """A host's share of the step's groups (rounded up)."""
    busy_hosts: int
    """Hosts that are given groups: fewer than `hosts` where the step's groups run out first."""
    step_s: float
    trainer_busy_s: float
    trainer_idle_fraction: float
    waits: str
    """Which side waits: "trainer" (for rollouts) or "rollout hosts" (for weights or the trainer)."""
    parts_s: dict[str, float]
    requests_per_step: dict[str, float]
    bytes_per_step: dict[str, float]


def _transfer_s(shape: FleetShape, nbytes: float) -> float:
    return shape.latency_s + nbytes / shape.stream_bytes_per_s


MEASURABLE = ("host_s", "fetch_s", "fanout_s", "busy_s")
"""The parts `plan_fleet(measured=…)` takes as measured: a host's batch (generation, write, curriculum), a
host's fetch of a version (what its generation waits for: its own read from storage, or with the relay its
object-store read), the fan-out (a version's pointer written until a waiting host holds it: the poll, and with
the relay its storage read, included), the trainer's work a step (everything but waiting for rollouts)."""


def plan_fleet(shape: FleetShape, hosts: int, measured: dict[str, float] | None = None) -> FleetPlan:
    """The steady-state step of `shape` with `hosts` rollout hosts. `measured` replaces the model's figure
    of any of the `MEASURABLE` parts with a measured one, so that the step's composition (the pipelining
    below) can be checked apart from the parts' costs (`bench/fleet.py` reports both)."""
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1, got {hosts}")
    s = shape
    groups_per_host = math.ceil(s.groups_per_step / hosts) if s.groups_per_step else s.groups_per_host
    step_groups = s.groups_per_step or hosts * s.groups_per_host
    files = min(hosts, step_groups)
    rollouts_per_host = groups_per_host * s.group_size
    step_rollouts = step_groups * s.group_size
    # lognormal(median, sigma 0.3) response lengths: the mean is exp(0.045) times the median
    response_tokens = s.response_tokens * math.exp(0.3**2 / 2)
    file_bytes = rollouts_per_host * (s.prompt_tokens + response_tokens) * s.file_bytes_per_token
    gen_s = rollouts_per_host * response_tokens / s.host_tokens_per_s
    slowest = 1 + s.jitter * (hosts - 1) / (hosts + 1)
    host_s = gen_s * slowest + _transfer_s(s, file_bytes) + CURRICULUM_CALL_S
    waves = math.ceil(files / s.read_concurrency)
    link = s.total_bytes_per_s or math.inf
    read_s = max(waves * _transfer_s(s, file_bytes), files * file_bytes / link)
    decode_s = step_rollouts / s.decode_rollouts_per_s
    ingest_tail_s = INGEST_TAIL_POLLS * 2 * s.latency_s + _transfer_s(s, file_bytes) + decode_s / files
    train_s = step_rollouts * (s.prompt_tokens + response_tokens) / s.train_tokens_per_s
    weight_bps = s.stream_bytes_per_s * s.weight_streams
    publish_s = POINTER_REQUESTS_PER_PUBLISH * s.latency_s + s.weight_bytes / weight_bps
    batch_s = step_rollouts / BATCH_ROLLOUTS_PER_S
    # the update, building its batch, the publish, the curriculum's step and the audit trail's record (one write)
    busy_s = train_s + batch_s + publish_s + CURRICULUM_CALL_S + s.latency_s
    poll_every = max(0.05, hosts / s.pointer_reads_per_s)
    # every host fetches every version (its own stream; all of them through the shared link), between batches
    fetch_s = 2 * s.latency_s + max(s.weight_bytes / weight_bps, hosts * s.weight_bytes / link)
    host_fetch_s = fetch_s  # what a host's generation waits for
    if s.fanout == "relay":  # the relay's one read (after its poll), then the object store
        # Ray pulls an object from any node that holds a copy, so copies double each round: log2(N + 1) rounds
        rounds = math.ceil(math.log2(hosts + 1))
        host_fetch_s = rounds * s.weight_bytes / s.relay_bytes_per_s if s.relay_bytes_per_s else 0.0
        # the hosts go on generating while the relay reads: only their object-store read holds them up
        fetch_s = RELAY_POLL_S / 2 + 2 * s.latency_s + s.weight_bytes / weight_bps + host_fetch_s
    # from the pointer's write to a waiting host holding the version (a relay's wait is in its fetch_s)
    fanout_s = fetch_s + (0.0 if s.fanout == "relay" else poll_every / 2)
    measured = measured or {}
    if set(measured) - set(MEASURABLE):
        raise ValueError(f"measured parts must be among {MEASURABLE}, got {sorted(measured)}")
    host_s, host_fetch_s, fanout_s, busy_s = (
        measured.get(k, v) for k, v in (("host_s", host_s), ("fetch_s", host_fetch_s), ("fanout_s", fanout_s),
                                        ("busy_s", busy_s)))
    cycle_s = host_s + host_fetch_s
    if s.max_staleness == 0:
        step_s = busy_s + fanout_s + host_s + ingest_tail_s
    else:  # a host's cycle, the trainer's work, or half the loop through both (weights t-1 make batch t+1)
        step_s = max(cycle_s, busy_s + ingest_tail_s, (fanout_s + host_s + ingest_tail_s + busy_s) / 2)
    idle = max(0.0, step_s - busy_s) / step_s
    host_idle = max(0.0, step_s - cycle_s)
    waits = "trainer" if step_s - busy_s >= host_idle else "rollout hosts"
    polls = busy_s / 1.0 + (step_s - busy_s) / 0.1  # every poll_interval_s (1 s) busy, 10-100 ms waiting
    return FleetPlan(
        hosts=hosts, groups_per_host=groups_per_host, busy_hosts=-(-step_groups // groups_per_host), step_s=step_s,
        trainer_busy_s=busy_s, trainer_idle_fraction=idle, waits=waits,
        parts_s={"generate": gen_s * slowest, "write": _transfer_s(s, file_bytes), "ingest": read_s + decode_s,
                 "batch": batch_s, "train": train_s, "publish": publish_s, "fetch": fetch_s,
                 "host_fetch": host_fetch_s, "fanout": fanout_s},
        requests_per_step={"rollout_writes": files, "rollout_reads": files, "rollout_lists": 2 * polls,
                           "weight_reads": 1 if s.fanout == "relay" else hosts,
                           "pointer_reads": (step_s / RELAY_POLL_S if s.fanout == "relay"
                                             else hosts + hosts * host_idle / poll_every)},
        bytes_per_step={"rollouts": files * file_bytes,
                        "weights": (2 if s.fanout == "relay" else hosts + 1) * s.weight_bytes},
    )


def relay_crossover(shape: FleetShape | None = None, max_hosts: int = 4096) -> int | None:
    """The smallest fleet at which a host holds a new version sooner through the relay than from storage
    (`FleetPlan.parts_s["fetch"]`), for `shape` (default: the fleet shape) with the pod's storage bandwidth
    and the object store's as given, else `POD_STORAGE_BYTES_PER_S` and `HOST_OBJECT_STORE_BYTES_PER_S`.
    Every host reading from storage is no slower until the hosts together reach the pod's storage
    bandwidth (N·W/total > W/stream); the relay pays one storage read and then log2(N + 1) object-store
    copies. The version's size cancels: with one stream, N = total·(1/stream + log2(N + 1)/object store)."""
    shape = shape or FleetShape()
    shape = dataclasses.replace(shape, total_bytes_per_s=shape.total_bytes_per_s or POD_STORAGE_BYTES_PER_S,
                                relay_bytes_per_s=shape.relay_bytes_per_s or HOST_OBJECT_STORE_BYTES_PER_S)
    for n in range(1, max_hosts + 1):
        relay = plan_fleet(dataclasses.replace(shape, fanout="relay"), n).parts_s["fetch"]
        if relay < plan_fleet(dataclasses.replace(shape, fanout="storage"), n).parts_s["fetch"]:
            return n
    return None


def smallest_fleet(shape: FleetShape, max_hosts: int = 4096) -> int | None:
    """The smallest number of hosts at which the trainer stops waiting (rollout hosts wait instead)."""
    for n in range(1, max_hosts + 1):
        if plan_fleet(shape, n).waits != "trainer":
            return n
    return None


def describe(plan: FleetPlan, shape: FleetShape) -> str:
    """`marinrl plan`'s text: the step, who waits, the parts, requests and bytes."""
    lines = [f"{plan.hosts} rollout hosts: a step every {plan.step_s:.2f} s; the trainer works "
             f"{plan.trainer_busy_s:.2f} s of it (idle {100 * plan.trainer_idle_fraction:.0f}%); "
             f"who waits: the {plan.waits}",
             "  per step: " + ", ".join(f"{k} {v:.3f} s" for k, v in plan.parts_s.items()),
             "  requests per step: " + ", ".join(f"{k} {v:.0f}" for k, v in plan.requests_per_step.items()),
             "  bytes per step: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in plan.bytes_per_step.items())]
    return "\n".join(lines + [f"  remark: {r}" for r in remarks(plan, shape)])


def remarks(plan: FleetPlan, shape: FleetShape) -> list[str]:
    """What a plan's fleet size gets wrong about the job: hosts the step's groups cannot all keep busy, a share
    of groups that is not whole (a job refuses `n_rollout_workers` that do not divide `groups_per_step`)."""
    groups = shape.groups_per_step
    if not groups:
        return []
    if plan.busy_hosts < plan.hosts:
        each = f"{plan.groups_per_host} group{'s' if plan.groups_per_host > 1 else ''} each"
        return [f"groups_per_step {groups} keeps {plan.busy_hosts} of the {plan.hosts} hosts busy ({each}), the "
                f"other {plan.hosts - plan.busy_hosts} idle: more hosts need a larger groups_per_step"]
    if groups % plan.hosts:
        return [f"groups_per_step {groups} does not divide among {plan.hosts} hosts (marinrl train refuses "
                f"n_rollout_workers={plan.hosts}): planned as {plan.groups_per_host} groups a host"]
    return []
