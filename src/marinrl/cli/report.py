"""`marinrl report RUN_DIR`: PNG plots and an HTML page of a run."""

from __future__ import annotations

import argparse

from marinrl.cli.errors import InputError


def run(args: argparse.Namespace) -> int:
    from marinrl.report import page as report

    try:
        return report.main(args.run_dir, args.output)
    except FileNotFoundError as e:
        raise InputError(str(e)) from e


def add_parser(sub) -> None:
    """The `report` subcommand's arguments."""
    p = sub.add_parser("report", help="PNG plots and an HTML page of a run (rewards, evals, staleness, step times)")
    p.add_argument("run_dir", help="a run directory, <run_root>/<run_id> (rollouts/, tensorboard/, logs/)")
    p.add_argument("--output", metavar="DIR", help="where to write index.html and the PNGs (default RUN_DIR/report)")
    p.set_defaults(run=run)
