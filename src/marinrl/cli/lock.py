"""`marinrl lock show RUN_DIR` / `marinrl lock check URL`: who holds a run folder's lease (and whether it is
stale), and whether a store honours the conditional writes the lease stands on (docs/storage.md, "One job per
run"). Reads Ray, JAX and the config layer not at all: it answers in about a second."""

from __future__ import annotations

import argparse
import os
import time

from marinrl.cli.errors import InputError
from marinrl.cli.inspect import _storage_options


def _existing_folder(url: str, storage_options: dict, what: str) -> None:
    """`url` is an existing folder (local) with credentials where it is on gs://; else InputError. An object
    store has no folders to find: a gs:// prefix is taken as given."""
    from marinrl.storage.fs import gcs_credentials_problem

    problem = gcs_credentials_problem(url) if "token" not in storage_options else None
    if problem:
        raise InputError(problem)
    if "://" in url and not url.startswith("file://"):
        return
    path = url.removeprefix("file://")
    if not os.path.exists(path):
        raise InputError(f"{url}: no such folder; give {what}")
    if not os.path.isdir(path):
        raise InputError(f"{url}: a file, not a folder; give {what}")


def _runs_under(url: str, storage_options: dict) -> list[str]:
    """The run folders directly under `url` that hold a lease: what a run root given for a run folder holds."""
    from marinrl.job.run_lock import LEASE_NAME
    from marinrl.storage.fs import open_root

    fs, path = open_root(url, storage_options, None)
    try:
        return sorted(p.rstrip("/").split("/")[-2] for p in fs.glob(f"{path.rstrip('/')}/*/{LEASE_NAME}"))
    except OSError:
        return []


def show(args: argparse.Namespace) -> int:
    """The lease of one run folder: its holder, and whether the next job would take it over (stale)."""
    from marinrl.job.run_lock import read_lease, stale_reason

    options = _storage_options(args.storage_option)
    what = "a run folder, <run_root>/<run_id>"
    _existing_folder(args.run_dir, options, what)
    try:
        lease = read_lease(args.run_dir, options)
    except ValueError as e:  # a lease that does not parse
        raise InputError(f"{e}; if no job runs there, delete it") from e
    except OSError as e:  # a lease this user may not read, a store that refuses
        raise InputError(f"{args.run_dir}: cannot read its lease ({type(e).__name__}: {e}); give {what} you can "
                         "read") from e
    if lease is None:
        runs = _runs_under(args.run_dir, options)
        if runs:
            raise InputError(f"{args.run_dir} is a run root, not a run folder: give one of its runs, "
                             + ", ".join(f"{args.run_dir.rstrip('/')}/{r}" for r in runs))
        print(f"{args.run_dir}: no lease (no job holds this run)")
        return 0
    now = time.time()
    reason = stale_reason(lease, now)
    if reason is None:
        print(f"{args.run_dir}: held by {lease.describe(now)}; job {lease.job_id}")
    else:
        print(f"{args.run_dir}: stale lease of {lease.describe(now)}; job {lease.job_id}: {reason}; the next job "
              "on this run takes it over")
    return 0


def check(args: argparse.Namespace) -> int:
    """Tries the lease's conditional writes on a scratch object under `url`; exit 1 if the store ignores any."""
    from marinrl.storage.conditional import check_preconditions

    options = _storage_options(args.storage_option)
    _existing_folder(args.url, options, "an existing folder to try the writes in")
    try:
        ignored = check_preconditions(args.url, options)
    except OSError as e:  # a folder this user may not write in
        raise InputError(f"{args.url}: cannot write a scratch object there ({type(e).__name__}: {e}); give a "
                         "folder you can write in") from e
    print(f"{args.url}: " + ("preconditions honoured" if not ignored else "IGNORES " + "; ".join(ignored)))
    return 0 if not ignored else 1


def add_parser(sub) -> None:
    """The `lock` subcommand and its own two, `show` and `check`."""
    p = sub.add_parser("lock", help="who holds a run folder (show); whether a store honours the lease's writes (check)",
                       description="The run lease, one job per run folder: docs/storage.md, \"One job per run\".")
    commands = p.add_subparsers(dest="lock_command", required=True)
    shown = commands.add_parser("show", help="the lease of a run folder: its holder, live or stale")
    shown.add_argument("run_dir", help="a run folder, <run_root>/<run_id>: a path, file://..., gs://...")
    checked = commands.add_parser("check", help="whether a store honours the lease's conditional writes (exit 1 if "
                                                "not); leaves nothing behind")
    checked.add_argument("url", help="an existing folder to try the writes in, e.g. gs://bucket/scratch")
    for parser, run in ((shown, show), (checked, check)):
        parser.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                            help="fsspec storage option, e.g. token=anon (repeatable)")
        # `command` names the subcommand in a one-line error: `marinrl lock show: ...`
        parser.set_defaults(run=run, command=f"lock {parser.prog.split()[-1]}")
