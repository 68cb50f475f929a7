"""`marinrl eval --checkpoint DIR --lessons ...`: a saved checkpoint on lessons, no Ray (docs/evaluation.md)."""

from __future__ import annotations

import argparse
import sys

from marinrl.cli.errors import InputError


def add_checkpoint_arguments(p: argparse.ArgumentParser, engine: str) -> None:
    """What `eval` and `serve` take to load a checkpoint: its architecture, its tokenizer, and the backend
    (`engine`: what the engine backend is for, in the command's words)."""
    p.add_argument("--model-config", metavar="FILE.yaml",
                   help="architecture and dtype for a Levanter checkpoint without model_config.json: a ModelConfig "
                        "YAML, or a job config with a `model:` section")
    p.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer directory (default: the checkpoint's, else bytes)")
    p.add_argument("--backend", choices=["scan", "engine"], default="scan", help=f"generation backend ({engine})")


def run(args: argparse.Namespace) -> int:
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


def add_parser(sub) -> None:
    """The `eval` subcommand's arguments."""
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
    add_checkpoint_arguments(p, engine="engine for models the scan sampler does not run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
