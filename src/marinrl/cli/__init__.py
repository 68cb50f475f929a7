"""`marinrl` console script: this module routes; each subcommand is a module of this package (its arguments in
`add_parser`, its work in `run`), which loads what the command drives only when it runs.

A mistake in what the user gave (a config, a path, a flag) is one or two lines on stderr,
`marinrl <command>: <file>:<line>:<col>: <what is wrong>`, and exit status 2, as argparse's own usage
errors; `--debug` adds the traceback. A run that fails for another reason exits 1 with its message.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Sequence

from marinrl.cli import eval as eval_command
from marinrl.cli import export_peft, inspect, lock, plan, report, serve, train
from marinrl.cli.errors import EXIT_CODES, InputError, InputExit

__all__ = ["EXIT_CODES", "InputError", "InputExit", "build_parser", "main"]

COMMANDS = (inspect, eval_command, serve, train, plan, report, lock, export_peft)
"""Each subcommand's module, in the order `marinrl --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marinrl", description="RL post-training for language models on JAX.")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (allowed anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a command; returns its exit status. An input error is printed and raised as InputExit
    (status 2), as argparse does for a usage error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # anywhere: `train` hands everything after its config to draccus
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        return args.run(args)
    except KeyboardInterrupt:  # what was worth saying (the checkpoint to resume from) is printed already
        print("[marinrl] interrupted", file=sys.stderr)
        return 130
    except InputError as e:
        if debug:
            traceback.print_exc()
        message = f"marinrl {args.command}: {e}"
        print(message, file=sys.stderr)
        raise InputExit(message) from e
    except RuntimeError as e:  # a job that failed (a trainer that died, a worker that keeps dying) says why
        if args.command != "train":
            raise
        if debug:
            traceback.print_exc()
        print(f"marinrl {args.command}: {e}", file=sys.stderr)
        return 1
