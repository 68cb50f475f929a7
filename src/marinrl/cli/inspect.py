"""`marinrl inspect ROOT`: a rollout root's files, rollouts and rewards per weight step and environment."""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from marinrl.cli.errors import InputError


def _storage_options(pairs: Sequence[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        options[key] = value
    return options


def _fmt_stats(stats: dict | None, digits: int = 3) -> str:
    return "-" if stats is None else f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def _check_rollout_root(root: str, storage_options: dict) -> None:
    """`root` exists and is a rollout root (an empty one is fine), not a run folder holding one."""
    from marinrl.storage.fs import gcs_credentials_problem, list_names, open_root

    problem = gcs_credentials_problem(root) if "token" not in storage_options else None
    if problem:
        raise InputError(problem)
    fs, path = open_root(root, storage_options, None)
    if not fs.exists(path):
        raise InputError(f"{root}: no such rollout root")
    if not fs.isdir(path):
        raise InputError(f"{root}: a file, not a rollout root (a folder of step=N/ folders)")
    names = list_names(fs, path)
    if "rollouts" in names and not any(n.startswith("step=") for n in names):
        raise InputError(f"{root} is a run folder, not a rollout root: inspect {root.rstrip('/')}/rollouts")


def run(args: argparse.Namespace) -> int:
    from marinrl.storage.inspection import summarize

    options = _storage_options(args.storage_option)
    _check_rollout_root(args.root, options)
    summary = summarize(args.root, storage_options=options)
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


def add_parser(sub) -> None:
    """The `inspect` subcommand's arguments."""
    p = sub.add_parser("inspect", help="summarize a rollout root (files, rollouts, rewards per step and env)")
    p.add_argument("root", help="rollout root: gs://bucket/path, file:///path, memory://..., or a bare path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option, e.g. token=anon (repeatable)")
    p.set_defaults(run=run)
