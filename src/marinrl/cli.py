"""`marinrl` console script. Each subcommand lives with the code it drives; this file only routes.

A mistake in what the user gave (a config, a path, a flag) is one or two lines on stderr,
`marinrl <command>: <file>:<line>:<col>: <what is wrong>`, and exit status 2, as argparse's own usage
errors; `--debug` adds the traceback. A run that fails for another reason exits 1 with its message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Sequence

EXIT_CODES = ("Exit status: 0 done; 2 an input error (a config field, a path, a flag: one line naming it, "
              "before Ray starts where it can be known; --debug adds the traceback); 1 a run that failed "
              "(its last line says why and what to do).")


class InputError(Exception):
    """A config, path or flag the user can fix: reported as one line, exit status 2."""


class InputExit(SystemExit):
    """What `main` raises for an InputError once it is printed: exit status 2, the message as its text."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


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


def cmd_inspect(args: argparse.Namespace) -> int:
    from marinrl.storage.rollouts import summarize

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
        raise _input_error(config, overrides, ConfigError("run_root", problem))
    if not isinstance(raw.get("run_id"), str):
        return
    try:
        refuse_if_held(f"{raw['run_root'].rstrip('/')}/{raw['run_id']}", raw["run_id"])
    except RunLockHeld as e:
        raise InputError(str(e)) from e
    except Exception:  # noqa: BLE001 - storage not reachable yet: the job's own lease decides
        return


def _input_error(config: str, overrides: Sequence[str], e: Exception) -> InputError:
    """A config mistake as the one line `marinrl train` prints: a ConfigError located in the file or flags."""
    from marinrl.config.errors import ConfigError, ConfigInputError, compose_yaml, locate

    if isinstance(e, ConfigError):
        return InputError(f"{locate(config, compose_yaml(config), overrides, e.field)}: {e}")
    if isinstance(e, ConfigInputError):
        return InputError(str(e))
    return InputError(f"{config}: {e}")  # a config class's own check, raised outside draccus


def cmd_train(args: argparse.Namespace) -> int:
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
        raise _input_error(args.config, args.overrides, e) from e
    from marinrl.job.rl_job import RLJob  # JAX, Levanter, Ray: seconds
    from marinrl.job.run_lock import RunLockHeld

    try:
        job = RLJob(config)  # every check that needs no Ray (marinrl.job.preflight)
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise _input_error(args.config, args.overrides, e) from e
    try:
        result = job.run()
    except ConfigError as e:  # the placement, checked against the cluster Ray found
        raise _input_error(args.config, args.overrides, e) from e
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


def cmd_eval(args: argparse.Namespace) -> int:
    from marinrl import eval as evaluation
    from marinrl.config.eval import EvalConfig
    from marinrl.config.server import InferenceServerConfig

    try:
        if args.curriculum:
            lessons = evaluation.load_lessons(args.curriculum, args.lessons)
        else:
            lessons = tuple(evaluation.parse_lesson(spec) for spec in args.lessons)
        config = EvalConfig(
            checkpoint=args.checkpoint, lessons=lessons, n_examples=args.n_examples, samples=args.samples,
            temperature=args.temperature, max_tokens=args.max_tokens, output=args.output,
            batch_size=args.batch_size, seed=args.seed, weight_step=args.weight_step,
            model=evaluation.load_model_config(args.model_config) if args.model_config else None,
            tokenizer=args.tokenizer, inference=InferenceServerConfig(backend=args.backend, serve_http=False),
            progress=not args.no_progress)
        prepared = evaluation.prepare(config)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise InputError(str(e)) from e
    try:
        result = evaluation.run(prepared)
    except evaluation.CheckpointLoadError as e:
        raise InputError(str(e)) from e
    failed = {k: v["metrics"].get("env_failures", 0) for k, v in result["lessons"].items()}
    failed = {k: int(v) for k, v in failed.items() if v}
    if failed:
        print(f"marinrl eval: environment failures (batches lost, see the log): {failed}", file=sys.stderr)
        return 1
    return 0


API_KEY_VARIABLE = "MARINRL_API_KEY"
"""Where `marinrl serve` reads its API key when `--api-key` is not given (a flag shows in `ps`)."""


def cmd_serve(args: argparse.Namespace) -> int:
    from marinrl.config.serve import ServeConfig
    from marinrl.config.server import EngineConfig, InferenceServerConfig

    try:
        model = None
        if args.model_config:
            from marinrl.eval import load_model_config

            model = load_model_config(args.model_config)
        inference = InferenceServerConfig(
            backend=args.backend, serve_http=True, host=args.host, port=args.port,
            api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None, model_name=args.model_name,
            default_max_tokens=args.default_max_tokens, dtype=args.dtype,
            engine=EngineConfig(max_seq_len=args.max_seq_len))
        config = ServeConfig(checkpoint=args.checkpoint, inference=inference, model=model, tokenizer=args.tokenizer,
                             weight_step=args.weight_step)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(str(e)) from e
    from marinrl import serve  # JAX and Levanter load only after the checks that need neither (serve.start)

    try:
        return serve.main(config)
    except (ValueError, OSError) as e:  # eval.CheckpointLoadError is a ValueError
        raise InputError(str(e)) from e


def cmd_report(args: argparse.Namespace) -> int:
    from marinrl.report import page as report

    try:
        return report.main(args.run_dir, args.output)
    except FileNotFoundError as e:
        raise InputError(str(e)) from e


def cmd_plan(args: argparse.Namespace) -> int:
    """The fleet planner (docs/planning.md): pure arithmetic over the config, no JAX, Ray or storage."""
    from marinrl.config.errors import ConfigError, ConfigInputError, load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.dry_run.fleet import describe, plan_fleet, shape_of_job, smallest_fleet

    try:
        config = load_job_config(RLJobConfig, args.config, args.overrides)
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise _input_error(args.config, args.overrides, e) from e
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marinrl", description="RL post-training for language models on JAX.")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (allowed anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarize a rollout root (files, rollouts, rewards per step and env)")
    p.add_argument("root", help="rollout root: gs://bucket/path, file:///path, memory://..., or a bare path")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option, e.g. token=anon (repeatable)")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("eval", help="evaluate a saved checkpoint on lessons (metrics JSON, rollout files, a table)",
                       description="Evaluate a Levanter or Hugging Face checkpoint with a RolloutManager (no Ray). "
                                   "See docs/evaluation.md.")
    p.add_argument("--checkpoint", required=True,
                   help="Levanter step-N directory or a run's checkpoint folder (latest step), or an HF checkpoint dir")
    p.add_argument("--lessons", "--lesson", nargs="+", action="extend", default=[], metavar="SPEC",
                   help="lessons: ENV, ENV:{json args} or ID=ENV:{json args} (ENV a registered name or a class "
                        "path); with --curriculum, ids of its lessons (default: all of them)")
    p.add_argument("--curriculum", metavar="FILE.yaml",
                   help="a CurriculumConfig YAML, or a job config with a `curriculum:` section")
    p.add_argument("--n-examples", type=int, default=32, help="prompts per lesson (default 32)")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt; K > 1 reports pass@K (default 1)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature of every lesson (default: each lesson's eval_temperature, 0 = greedy)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget of every lesson (default: each lesson's max_tokens)")
    p.add_argument("--output", metavar="DIR", help="write DIR/metrics.json and DIR/rollouts/ (default: write nothing)")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per manager call (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-step", type=int, default=None,
                   help="weight step stamped on the rollouts (default: the checkpoint's)")
    p.add_argument("--model-config", metavar="FILE.yaml",
                   help="architecture and dtype for a Levanter checkpoint without model_config.json: a ModelConfig "
                        "YAML, or a job config with a `model:` section")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer directory (default: the checkpoint's, else bytes)")
    p.add_argument("--backend", choices=["scan", "engine"], default="scan",
                   help="generation backend (engine for models the scan sampler does not run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_eval)

    p = sub.add_parser("serve", help="serve a checkpoint: the OpenAI-compatible endpoint and the token endpoint",
                       description="Serve a Levanter or Hugging Face checkpoint over HTTP until Ctrl-C or SIGTERM: "
                                   "/v1/chat/completions, /v1/completions, /v1/models and the token endpoint "
                                   "/inference/v1/generate (what verifiers' train client calls). See "
                                   "docs/inference.md.")
    p.add_argument("checkpoint",
                   help="Levanter step-N directory or a run's checkpoint folder (latest step), or an HF checkpoint dir")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); any other (e.g. 0.0.0.0) needs an API key")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=None,
                   help=f"the key every request must send as 'Authorization: Bearer <key>' (default: "
                        f"${API_KEY_VARIABLE}, else a random key printed at start)")
    p.add_argument("--model-name", default="marinrl-policy", help="the model name the endpoint reports")
    p.add_argument("--model-config", metavar="FILE.yaml",
                   help="architecture and dtype for a Levanter checkpoint without model_config.json: a ModelConfig "
                        "YAML, or a job config with a `model:` section")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer directory (default: the checkpoint's, else bytes)")
    p.add_argument("--backend", choices=["scan", "engine"], default="scan",
                   help="generation backend (engine: continuous batching, and models the scan sampler does not run)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="serve the weights in this dtype (default: --model-config's dtype, else float32)")
    p.add_argument("--max-seq-len", type=int, default=512,
                   help="engine backend: the longest prompt + generation (default 512)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="the token budget of a request that gives none (default 256)")
    p.add_argument("--weight-step", type=int, default=None,
                   help="the weight step reported on every token (default: the checkpoint's)")
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser("train", help="run an RL job (trainer, rollout workers, curriculum) on Ray from a YAML config",
                       description="Run an RL job from a YAML config (RLJobConfig): its fields, defaults and "
                                   "ranges are in docs/configuration.md; every error message in "
                                   "docs/troubleshooting.md.",
                       epilog=EXIT_CODES + " Ctrl-C: a final checkpoint, then 130 (a second Ctrl-C quits at "
                              "once). Example: marinrl train experiments/quickstart.yaml --num_train_steps 20")
    p.add_argument("config", help="RLJobConfig YAML, e.g. experiments/quickstart.yaml")
    p.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="--key value overrides (draccus), e.g. --max_staleness 0")
    p.set_defaults(run=cmd_train)

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
    p.set_defaults(run=cmd_plan, overrides=[])

    p = sub.add_parser("report", help="PNG plots and an HTML page of a run (rewards, evals, staleness, step times)")
    p.add_argument("run_dir", help="a run directory, <run_root>/<run_id> (rollouts/, tensorboard/, logs/)")
    p.add_argument("--output", metavar="DIR", help="where to write index.html and the PNGs (default RUN_DIR/report)")
    p.set_defaults(run=cmd_report)
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


if __name__ == "__main__":
    sys.exit(main())
