"""`marinrl plan CONFIG`: the fleet planner (docs/planning.md)."""

from __future__ import annotations

import argparse

from marinrl.cli.errors import InputError, config_input_error


def run(args: argparse.Namespace) -> int:
    """The fleet planner (docs/planning.md): pure arithmetic over the config, no JAX, Ray or storage."""
    from marinrl.config.errors import ConfigError, ConfigInputError, load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.dry_run.fleet import describe, plan_fleet, shape_of_job, smallest_fleet

    try:
        config = load_job_config(RLJobConfig, args.config, args.overrides)
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise config_input_error(args.config, args.overrides, e) from e
    from marinrl.config.transfer import RELAY_FROM_HOSTS

    extra = {"latency_s": args.latency_ms / 1e3, "stream_bytes_per_s": args.stream_mb_s * 1e6,
             "weight_streams": args.weight_streams, "total_bytes_per_s": args.pod_storage_gb_s * 1e9 or None,
             "relay_bytes_per_s": args.relay_gb_s * 1e9 if args.relay_gb_s else None}

    def fanout(n: int) -> str:  # `auto` as the job decides it (FilesystemTransferConfig.for_fleet)
        return args.fanout if args.fanout != "auto" else "relay" if n >= RELAY_FROM_HOSTS else "storage"

    try:
        shapes = {n: shape_of_job(config, n, accelerator=args.accelerator, trainer_chips=args.trainer_chips,
                                  host_tokens_per_s=args.host_tokens_per_s, params=args.params,
                                  prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
                                  fanout=fanout(n), **extra)
                  for n in args.rollout_hosts}
    except ValueError as e:
        raise InputError(str(e)) from e
    for n, shape in shapes.items():
        print(describe(plan_fleet(shape, n), shape))
    first = next(iter(shapes.values()))
    n = smallest_fleet(first)
    print(f"the trainer stops waiting at {n} rollout hosts" if n
          else "the trainer waits at every fleet size up to 4096")
    return 0


def add_parser(sub) -> None:
    """The `plan` subcommand's arguments."""
    p = sub.add_parser("plan", help="a fleet's step time, who waits, requests and bytes per step (no JAX, no Ray)",
                       description="The fleet planner: docs/planning.md.")
    p.add_argument("config", help="RLJobConfig YAML")
    p.add_argument("--rollout_hosts", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--accelerator", default="cpu", help="a row of marinrl.dry_run.fleet.ACCELERATORS (default cpu)")
    p.add_argument("--trainer_chips", type=int, default=1)
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
