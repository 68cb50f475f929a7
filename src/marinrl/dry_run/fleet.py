"""The fleet planner: one trainer and N rollout hosts talking through object storage, per step, as pure
arithmetic (no JAX, no Ray, no storage): what `marinrl plan` prints and `bench/fleet.py` checks
(docs/planning.md; tests/test_fleet.py holds it to the bench within ±25% on step time and idle fraction).

The model (every figure per trainer step; `FleetShape` names the inputs, `plan_fleet` returns `FleetPlan`):

- a host generates `groups_per_host × group_size` responses at `host_tokens_per_s` (the slowest of N
  hosts, with generation times uniform in ±`jitter`, takes `1 + jitter·(N−1)/(N+1)` times the mean),
  writes one file (one request: latency + bytes over a stream), asks the curriculum for a lesson;
- the trainer reads the step's N files (two listings, then reads `read_concurrency` at a time, each
  a latency plus its bytes over a stream, all of them no faster than the shared link; decoding at
  `decode_rollouts_per_s`), updates (`train_tokens_per_s`, or the dry run's FLOPs over a chip's
  peak × MFU: `trainer_tokens_per_s`), publishes a version (its bytes over one stream plus the
  pointer's and the clean-up's requests);
- the hosts see it after a pointer read (a waiting host polls every `fleet / pointer_reads_per_s`
  seconds, half that on average) and fetch it: a stream each, N versions through the shared link;
- with `max_staleness = 0` all of that is one chain per step; with `max_staleness >= 1` a host
  generates step t's batch with weights t − 1 while the trainer trains step t − 1, so the period is
  the longest of the hosts' cycle, the trainer's work, and half the loop through both.
"""

from __future__ import annotations

import dataclasses
import math

ACCELERATORS: dict[str, dict[str, float]] = {
    # chip: bf16 dense peak FLOP/s per chip (vendor figures), an assumed training MFU, and an assumed
    # generation speed of one rollout host (tokens/s, a 0.6B–8B model with batched decoding). The CPU
    # row is this repository's measured figures (docs/performance.md, bench/fleet.py defaults).
    "cpu": {"peak_flops": 1.8e11, "mfu": 0.5, "host_tokens_per_s": 8_000.0},
    "v4": {"peak_flops": 2.75e14, "mfu": 0.4, "host_tokens_per_s": 20_000.0},
    "v5e": {"peak_flops": 1.97e14, "mfu": 0.4, "host_tokens_per_s": 15_000.0},
    "v5p": {"peak_flops": 4.59e14, "mfu": 0.4, "host_tokens_per_s": 30_000.0},
    "v6e": {"peak_flops": 9.18e14, "mfu": 0.4, "host_tokens_per_s": 40_000.0},
    "a100": {"peak_flops": 3.12e14, "mfu": 0.4, "host_tokens_per_s": 20_000.0},
    "h100": {"peak_flops": 9.89e14, "mfu": 0.4, "host_tokens_per_s": 50_000.0},
}
"""Chip peaks (bf16 dense, per chip) and the assumptions the planner makes per accelerator."""

ROLLOUT_FILE_BYTES_PER_TOKEN = 13.5
"""Parquet bytes per token of a rollout file (token ids, logprobs, masks, rewards), measured with
`bench/fleet.py` (32k vocabulary, 128 + 384 tokens); a group's prompt is stored with each rollout."""
DECODE_ROLLOUTS_PER_S = 45_000.0
"""The trainer's decoding speed of rollout files (bench/storage.py on a 2-core AMD EPYC)."""
CURRICULUM_CALL_S = 0.002
"""One waited curriculum call (a lesson) through Ray on one machine."""
POINTER_REQUESTS_PER_PUBLISH = 5
"""A publish's requests besides the version's bytes: the pointer read and written, listing and deleting
the oldest version, the snapshot-request listing."""
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

    @classmethod
    def from_bench(cls, args) -> FleetShape:
        """The shape of a `bench/fleet.py` run (its argparse namespace)."""
        return cls(groups_per_host=args.groups_per_host, group_size=args.group_size,
                   prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
                   host_tokens_per_s=args.host_tokens_per_s, jitter=args.jitter,
                   train_tokens_per_s=args.train_tokens_per_s, max_staleness=args.max_staleness,
                   latency_s=args.latency_ms / 1e3, stream_bytes_per_s=args.stream_mb_s * 1e6,
                   total_bytes_per_s=args.total_mb_s * 1e6 or None, weight_bytes=args.weight_stands_for_mb * 1e6,
                   pointer_reads_per_s=args.pointer_reads_per_s)


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    hosts: int
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


def plan_fleet(shape: FleetShape, hosts: int) -> FleetPlan:
    """The steady-state step of `shape` with `hosts` rollout hosts."""
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1, got {hosts}")
    s = shape
    rollouts_per_host = s.groups_per_host * s.group_size
    # lognormal(median, sigma 0.3) response lengths: the mean is exp(0.045) times the median
    response_tokens = s.response_tokens * math.exp(0.3**2 / 2)
    file_bytes = rollouts_per_host * (s.prompt_tokens + response_tokens) * s.file_bytes_per_token
    gen_s = rollouts_per_host * response_tokens / s.host_tokens_per_s
    slowest = 1 + s.jitter * (hosts - 1) / (hosts + 1)
    host_s = gen_s * slowest + _transfer_s(s, file_bytes) + CURRICULUM_CALL_S
    waves = math.ceil(hosts / s.read_concurrency)
    link = s.total_bytes_per_s or math.inf
    read_s = max(waves * _transfer_s(s, file_bytes), hosts * file_bytes / link)
    decode_s = hosts * rollouts_per_host / s.decode_rollouts_per_s
    ingest_tail_s = INGEST_TAIL_POLLS * 2 * s.latency_s + _transfer_s(s, file_bytes) + decode_s / hosts
    train_s = hosts * rollouts_per_host * (s.prompt_tokens + response_tokens) / s.train_tokens_per_s
    publish_s = POINTER_REQUESTS_PER_PUBLISH * s.latency_s + s.weight_bytes / s.stream_bytes_per_s
    busy_s = train_s + publish_s + CURRICULUM_CALL_S
    poll_every = max(0.05, hosts / s.pointer_reads_per_s)
    fetch_s = max(_transfer_s(s, s.weight_bytes), hosts * s.weight_bytes / link)
    fanout_s = poll_every / 2 + s.latency_s + fetch_s
    if s.max_staleness == 0:
        step_s = busy_s + fanout_s + host_s + ingest_tail_s
    else:
        step_s = max(host_s, busy_s + ingest_tail_s, (fanout_s + host_s + ingest_tail_s + busy_s) / 2)
    idle = max(0.0, step_s - busy_s) / step_s
    host_idle = max(0.0, step_s - host_s)
    waits = "trainer" if step_s - busy_s >= host_idle else "rollout hosts"
    polls = step_s / 0.1 if idle > 0 else 1.0
    return FleetPlan(
        hosts=hosts, step_s=step_s, trainer_busy_s=busy_s, trainer_idle_fraction=idle, waits=waits,
        parts_s={"generate": gen_s * slowest, "write": _transfer_s(s, file_bytes), "ingest": read_s + decode_s,
                 "train": train_s, "publish": publish_s, "fanout": fanout_s},
        requests_per_step={"rollout_writes": hosts, "rollout_reads": hosts, "rollout_lists": 2 * polls,
                           "weight_reads": hosts, "pointer_reads": hosts * (1 + host_idle / poll_every * 0)},
        bytes_per_step={"rollouts": hosts * file_bytes, "weights": (hosts + 1) * s.weight_bytes},
    )


def smallest_fleet(shape: FleetShape, max_hosts: int = 4096) -> int | None:
    """The smallest number of hosts at which the trainer stops waiting (rollout hosts wait instead)."""
    for n in range(1, max_hosts + 1):
        if plan_fleet(shape, n).waits != "trainer":
            return n
    return None
