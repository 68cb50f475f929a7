"""`marinrl` console script. Each subcommand lives with the code it drives; this file only routes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _storage_options(pairs: Sequence[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--storage-option expects KEY=VALUE, got {pair!r}")
        options[key] = value
    return options


def _fmt_stats(stats: dict | None, digits: int = 3) -> str:
    return "-" if stats is None else f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def cmd_inspect(args: argparse.Namespace) -> int:
    from marinrl.storage import summarize

    summary = summarize(args.root, storage_options=_storage_options(args.storage_option))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    totals = summary["totals"]
    print(f"{summary['root']}: {totals['files']} files, {totals['rollouts']} rollouts, {totals['groups']} groups, "
          f"{totals['quarantined']} quarantined, {totals['unreadable']} unreadable\n")
    _print_table(
        ["weight_step", "files", "rollouts", "groups", "reward"],
        [[s, str(v["files"]), str(v["rollouts"]), str(v["groups"]), _fmt_stats(v["reward"])]
         for s, v in summary["steps"].items()],
    )
    print()
    _print_table(
        ["env", "rollouts", "reward", "response_length", "finish_reasons"],
        [[env, str(v["rollouts"]), _fmt_stats(v["reward"]), _fmt_stats(v["response_length"], 1),
          ", ".join(f"{k}={n}" for k, n in sorted(v["finish_reasons"].items()))]
         for env, v in summary["envs"].items()],
    )
    for problem in summary["unreadable"]:
        print(f"unreadable: {problem}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import draccus

    from marinrl.job import RLJob, RLJobConfig

    config = draccus.parse(RLJobConfig, config_path=args.config, args=args.overrides)
    result = RLJob(config).run()
    train = result.train
    print(f"[marinrl] {config.run_id}: trained steps {train['first_step']}..{train['final_step']} in "
          f"{result.seconds:.0f} s; checkpoint {train['checkpoint']}; rollout worker restarts {result.rollout_restarts}")
    for summary in result.rollouts:
        evals = [e for e in summary.get("evals", []) if e["kind"] == "eval"]
        if evals:
            last = evals[-1]
            rewards = {k: round(v, 3) for k, v in last["metrics"].items() if k.endswith("/reward_mean")}
            print(f"[marinrl] {summary['worker_id']} eval at weight step {last['weight_step']}: {rewards}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from marinrl import report

    try:
        return report.main(args.run_dir, args.output)
    except FileNotFoundError as e:
        raise SystemExit(f"marinrl report: {e}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marinrl", description="RL post-training for language models on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarize a rollout root (files, rollouts, rewards per step and env)")
    p.add_argument("root", help="rollout root: gs://bucket/path, file:///path, memory://..., or a bare path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option, e.g. token=anon (repeatable)")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("train", help="run an RL job (trainer, rollout workers, curriculum) on Ray from a YAML config")
    p.add_argument("config", help="RLJobConfig YAML, e.g. experiments/quickstart.yaml")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value overrides (draccus), e.g. --max_staleness 0")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("report", help="PNG plots and an HTML page of a run (rewards, evals, staleness, step times)")
    p.add_argument("run_dir", help="a run directory, <run_root>/<run_id> (rollouts/, tensorboard/, logs/)")
    p.add_argument("--output", metavar="DIR", help="where to write index.html and the PNGs (default RUN_DIR/report)")
    p.set_defaults(run=cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
