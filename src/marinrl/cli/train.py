"""`marinrl train CONFIG [--key value ...]`: an RL job from its YAML config, mistakes answered cheapest first."""

from __future__ import annotations

import argparse
from typing import Sequence

from marinrl.cli.errors import EXIT_CODES, InputError, config_input_error


def _refuse_if_run_held(config: str, overrides: Sequence[str]) -> None:
    """A run another live job holds is refused before the config's imports (JAX, Levanter: seconds);
    only when the file or the flags name `run_root` and `run_id` (else RLJob.run's lease refuses it)."""
    from marinrl.config.errors import ConfigError, ConfigInputError, compose_yaml, merged_raw
    from marinrl.job.run_lock import RunLockHeld, refuse_if_held
    from marinrl.storage.fs import gcs_credentials_problem

    try:
        compose_yaml(config)
        raw = merged_raw(config, overrides)
    except (ConfigInputError, OSError):  # load_job_config says what is wrong
        return
    if not isinstance(raw, dict) or not isinstance(raw.get("run_root"), str):
        return
    problem = gcs_credentials_problem(raw["run_root"])  # before gcsfs reads the lease: a minute of retries
    if problem:
        raise config_input_error(config, overrides, ConfigError("run_root", problem))
    if not isinstance(raw.get("run_id"), str):
        return
    try:
        refuse_if_held(f"{raw['run_root'].rstrip('/')}/{raw['run_id']}", raw["run_id"])
    except RunLockHeld as e:
        raise InputError(str(e)) from e
    except Exception:  # noqa: BLE001 - storage not reachable yet: the job's own lease decides
        return


def run(args: argparse.Namespace) -> int:
    """Three stages, cheapest first, so a mistake answers before the next stage's cost: the run's lease and
    the config's fields, ranges and placement arithmetic (no JAX, Levanter or Ray: about a second), then the
    checks that build environments and read the model's config (`preflight`), then the job."""
    _refuse_if_run_held(args.config, args.overrides)
    from marinrl.config.errors import ConfigError, ConfigInputError, load_job_config
    from marinrl.config.job import RLJobConfig

    try:
        config = load_job_config(RLJobConfig, args.config, args.overrides)
        config.validate()
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise config_input_error(args.config, args.overrides, e) from e
    from marinrl.job.rl_job import RLJob  # JAX, Levanter, Ray: seconds
    from marinrl.job.run_lock import RunLockHeld

    try:
        job = RLJob(config)  # every check that needs no Ray (marinrl.job.preflight)
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise config_input_error(args.config, args.overrides, e) from e
    try:
        result = job.run()
    except ConfigError as e:  # the placement, checked against the cluster Ray found
        raise config_input_error(args.config, args.overrides, e) from e
    except RunLockHeld as e:  # another job holds this run: one line naming it, exit status 2
        raise InputError(str(e)) from e
    print(summary_line(config.run_id, result.train, result.seconds, result.rollout_restarts))
    for summary in result.rollouts:
        evals = [e for e in summary.get("evals", []) if e["kind"] == "eval"]
        if evals:
            last = evals[-1]
            reasons = last.get("reasons", {})  # why a reward is nan (the environment failed, every group dropped)
            rewards = ", ".join(f"{k}: {round(v, 3)}" + (f" ({reasons[k]})" if k in reasons else "")
                                for k, v in last["metrics"].items() if k.endswith("/reward_mean"))
            print(f"[marinrl] {summary['worker_id']} eval at weight step {last['weight_step']}: {rewards}")
    return 0


def summary_line(run_id: str, train: dict, seconds: float, restarts: int) -> str:
    """The last line of a job: what was trained and the checkpoint it ends on (a run already at
    num_train_steps trains nothing and writes none: the one it resumed from)."""
    if train["first_step"] == train["final_step"]:
        return (f"[marinrl] {run_id}: already at step {train['final_step']} (checkpoint {train.get('resumed_from')}): "
                "nothing to train; raise num_train_steps to train further")
    return (f"[marinrl] {run_id}: trained steps {train['first_step']}..{train['final_step']} in {seconds:.0f} s; "
            f"checkpoint {train['checkpoint']}; rollout worker restarts {restarts}")


def add_parser(sub) -> None:
    """The `train` subcommand's arguments."""
    p = sub.add_parser("train", help="run an RL job (trainer, rollout workers, curriculum) on Ray from a YAML config",
                       description="Run an RL job from a YAML config (RLJobConfig): its fields, defaults and "
                                   "ranges are in docs/configuration.md; every error message in "
                                   "docs/troubleshooting.md.",
                       epilog=EXIT_CODES + " Ctrl-C: a final checkpoint, then 130 (a second Ctrl-C quits at "
                              "once). Example: marinrl train experiments/quickstart.yaml --num_train_steps 20")
    p.add_argument("config", help="RLJobConfig YAML, e.g. experiments/quickstart.yaml")
    p.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="--key value overrides (draccus), e.g. --max_staleness 0")
    p.set_defaults(run=run)
