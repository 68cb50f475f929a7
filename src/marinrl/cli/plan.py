"""`marinrl plan CONFIG`: the fleet planner (docs/planning.md)."""

from __future__ import annotations

import argparse
import math

from marinrl.cli.errors import InputError, config_input_error

FLAG_MAXIMUM = 1e15
"""The most any numeric flag may be (hosts, chips, parameters, tokens a second, ...): beyond it the arithmetic
overflows long before a real fleet would."""
FLAG_MINIMUMS = (  # (flag, the least value that makes sense, whether it may equal it, what it counts)
    ("rollout_hosts", 1, True, "rollout hosts"), ("trainer_chips", 1, True, "trainer chips"),
    ("host_tokens_per_s", 0, False, "tokens a second"), ("params", 0, False, "parameters"),
    ("prompt_tokens", 1, True, "tokens"), ("response_tokens", 1, True, "tokens"),
    ("latency_ms", 0, True, "milliseconds"), ("stream_mb_s", 0, False, "MB a second"),
    ("weight_streams", 1, True, "streams"), ("pod_storage_gb_s", 0, True, "GB a second (0: no limit)"),
    ("relay_gb_s", 0, True, "GB a second (0: no limit)"),
)
"""The planner's numeric flags and their ranges (up to `FLAG_MAXIMUM`): anything else, nan included, is refused in
one line before the config loads."""


def check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag finite and in its range (`FLAG_MINIMUMS`), `--accelerator` a row of the planner's table,
    else an InputError naming the flag."""
    from marinrl.dry_run.fleet_inputs import ACCELERATORS

    if args.accelerator is not None and args.accelerator not in ACCELERATORS:
        raise InputError(f"--accelerator: {args.accelerator!r} is not a chip the planner has figures for: one of "
                         f"{', '.join(ACCELERATORS)}")
    for name, least, inclusive, what in FLAG_MINIMUMS:
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value is None:
                continue
            if not (value >= least if inclusive else value > least) or not value <= FLAG_MAXIMUM:
                bound = f">= {least}" if inclusive else f"> {least}"
                raise InputError(f"--{name}: {value} is not a number of {what}: give a number {bound} and "
                                 f"<= {FLAG_MAXIMUM:g}")


def run(args: argparse.Namespace) -> int:
    """The fleet planner (docs/planning.md): pure arithmetic over the config, no JAX, Ray or storage. The config is
    checked as `marinrl train` checks it (an unknown TPU kind is refused the same way), then planned with the
    accelerators its placement names, and every figure the plan assumed is printed before the plans."""
    from marinrl.config.errors import ConfigError, ConfigInputError, load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.config.transfer import RELAY_FROM_HOSTS
    from marinrl.dry_run.fleet import describe, plan_fleet, smallest_fleet
    from marinrl.dry_run.fleet_inputs import job_inputs

    check_flags(args)
    try:
        config = load_job_config(RLJobConfig, args.config, args.overrides)
        config.validate()
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise config_input_error(args.config, args.overrides, e) from e
    try:
        inputs = job_inputs(config, accelerator=args.accelerator, trainer_chips=args.trainer_chips,
                            host_tokens_per_s=args.host_tokens_per_s, params=args.params,
                            prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens)
    except ValueError as e:
        raise InputError(f"{args.config}: {e}") from e
    extra = {"latency_s": args.latency_ms / 1e3, "stream_bytes_per_s": args.stream_mb_s * 1e6,
             "weight_streams": args.weight_streams, "total_bytes_per_s": args.pod_storage_gb_s * 1e9 or None,
             "relay_bytes_per_s": args.relay_gb_s * 1e9 or None}

    def fanout(n: int) -> str:  # `auto` as the job decides it (FilesystemTransferConfig.for_fleet)
        return args.fanout if args.fanout != "auto" else "relay" if n >= RELAY_FROM_HOSTS else "storage"

    plans = {n: (plan_fleet(inputs.shape(fanout=fanout(n), **extra), n), inputs.shape(fanout=fanout(n), **extra))
             for n in args.rollout_hosts}
    if not all(math.isfinite(plan.step_s) for plan, _ in plans.values()):
        raise InputError("the flags' figures make a step of no finite length (--params, --stream_mb_s, --latency_ms, "
                         "--host_tokens_per_s): give figures a real fleet could have")
    print("assumptions (each flag overrides its figure; docs/planning.md):")
    for line in inputs.lines() + storage_lines(args, RELAY_FROM_HOSTS):
        print(f"  {line}")
    for plan, shape in plans.values():
        print(describe(plan, shape))
    n = smallest_fleet(next(iter(plans.values()))[1])
    print(f"the trainer stops waiting at {n} rollout hosts" if n
          else "the trainer waits at every fleet size up to 4096")
    return 0


def storage_lines(args: argparse.Namespace, relay_from: int) -> list[str]:
    """The storage and fan-out figures a plan used, from the flags (their defaults: the planner's assumptions)."""
    pod = f"{args.pod_storage_gb_s:g} GB/s" if args.pod_storage_gb_s else "no limit"
    relay = f"{args.relay_gb_s:g} GB/s a host" if args.relay_gb_s else "no limit"
    fanout = (f"auto: every host reads each version from storage below {relay_from} hosts, the relay from "
              f"{relay_from}" if args.fanout == "auto" else args.fanout)
    return [f"storage: {args.latency_ms:g} ms a request, {args.stream_mb_s:g} MB/s a stream, {args.weight_streams} "
            f"weight stream(s), the pod's reads {pod} in all (--latency_ms, --stream_mb_s, --weight_streams, "
            "--pod_storage_gb_s)",
            f"fan-out: {fanout}; the relay's object store {relay} (--fanout, --relay_gb_s)"]


def add_parser(sub) -> None:
    """The `plan` subcommand's arguments."""
    p = sub.add_parser("plan", help="a fleet's step time, who waits, requests and bytes per step (no JAX, no Ray)",
                       description="The fleet planner: docs/planning.md.")
    p.add_argument("config", help="RLJobConfig YAML")
    p.add_argument("--rollout_hosts", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--accelerator", default=None,
                   help="both roles' chip, a row of marinrl.dry_run.fleet_inputs.ACCELERATORS (default: each role's "
                        "from the config's ray.trainer and ray.rollout; cpu where they name no accelerator)")
    p.add_argument("--trainer_chips", type=int, default=None,
                   help="the trainer's chips (default: the config's ray.trainer, 1 with --accelerator)")
    p.add_argument("--host_tokens_per_s", type=float, default=None,
                   help="one rollout host's generation speed (default: the accelerator's row)")
    p.add_argument("--params", type=float, default=None, help="parameters (e.g. 8e9) of a checkpoint-named model")
    p.add_argument("--prompt_tokens", type=int, default=None, help="default: batching.max_length - response")
    p.add_argument("--response_tokens", type=int, default=None, help="default: the lessons' largest max_tokens")
    p.add_argument("--latency_ms", type=float, default=30.0)
    p.add_argument("--stream_mb_s", type=float, default=200.0)
    p.add_argument("--weight_streams", type=int, default=1,
                   help="streams a version is written and read with (a sharded tensorstore version: many)")
    p.add_argument("--fanout", choices=["auto", "storage", "relay"], default="auto",
                   help="storage: every host reads each version; relay: read once, then Ray's object store; "
                        "auto: the job's default (relay from marinrl.config.transfer.RELAY_FROM_HOSTS hosts)")
    p.add_argument("--pod_storage_gb_s", type=float, default=25.0,
                   help="the pod's total read bandwidth from storage, GB/s (default: the planner's assumption, "
                        "marinrl.dry_run.fleet.POD_STORAGE_BYTES_PER_S; 0: no limit)")
    p.add_argument("--relay_gb_s", type=float, default=3.0,
                   help="a host's object-store bandwidth with the relay (default: the planner's assumption, "
                        "marinrl.dry_run.fleet.HOST_OBJECT_STORE_BYTES_PER_S)")
    p.set_defaults(run=run, overrides=[])
