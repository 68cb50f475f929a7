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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marinrl", description="RL post-training for language models on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarize a rollout root (files, rollouts, rewards per step and env)")
    p.add_argument("root", help="rollout root: gs://bucket/path, file:///path, memory://..., or a bare path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option, e.g. token=anon (repeatable)")
    p.set_defaults(run=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
