"""A recipe's command line: `python experiments/<recipe>.py [--key value ...] [--dry_run]`.

A recipe is a Python file with its job config as YAML text (`RECIPE`) and a `main(config)`. Its flags
are `RLJobConfig`'s, as for `marinrl train` (`--run_root gs://…`, `--model.hf_checkpoint …`), applied
over the recipe's YAML: draccus builds a nested config that a flag touches from its class's defaults,
so defaults written as Python objects would be lost on the first `--model.x` flag, while a YAML file
under the flags keeps every other value.

`--dry_run` runs `marinrl.dry_run` instead of the job: the config is parsed and validated, the process
gets as many fake CPU devices as the trainer has (set before JAX's backend starts), the train step is
lowered and the rollout backend's programs (Levanter's engine, or the scan sampler) are compiled at the
recipe's shapes, and each role's memory per device and the FLOPs per step are printed (docs/scaling.md).
`--dry_run.layers N`, `--dry_run.prompt_tokens N` and `--dry_run.response_tokens N` change the depth
lowered and the token shapes (`DryRunShapes`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Callable, Optional, Sequence

DRY_RUN_FLAG = "--dry_run"
_CHILD_ENV = "MARINRL_DRY_RUN_DEVICES"

GRPO_AT_SCALE = """
model:
  dtype: float32                  # the trainer's master weights and AdamW state (trainer.mp: p=f32)
  model: {gradient_checkpointing: auto}  # off where the update fits the trainer's device without it
max_staleness: 1
optimizer: {learning_rate: 1.0e-6, lr_schedule: constant, warmup: 10, weight_decay: 0.0, max_grad_norm: 1.0}
# bf16 rollouts: the ratio against the trainer's own pi_old, times TIS min(pi_old/mu, 2) for the mismatch
loss: {kl_beta: 0.0, ratio_anchor: recomputed, correction: tis, tis_cap: 2.0}
batching: {min_bucket: 256}
trainer:
  mp: p=f32,c=bfloat16
  model_axis_size: 1              # FSDP over all of the trainer's chips (Levanter's default mesh)
  per_device_parallelism: auto    # the largest microbatch whose update fits the trainer's device
inference:
  backend: engine
  dtype: bfloat16                 # rollout weights, KV cache and every published version (half the f32 bytes)
ray:
  address: auto
"""
"""What the GRPO recipes under experiments/ share: bf16 compute over f32 parameters and AdamW state,
bf16 rollouts (and weight versions) with the sampler/trainer mismatch corrected by TIS, gradient
checkpointing where the update does not fit the trainer's device without it and the largest microbatch that
fits (`auto`, docs/training.md, "Memory of the update"), FSDP, no KL term, the
engine backend, an existing Ray cluster. A recipe writes the rest (`recipe_yaml(GRPO_AT_SCALE, ...)`);
docs/models.md, "Dtypes"."""


def recipe_yaml(base: str, recipe: str, *, replace: Sequence[str] = ()) -> str:
    """YAML of `recipe` over `base`: mappings merge key by key (the recipe's value wins), anything else
    (lists included) is the recipe's; a top-level key in `replace` takes the recipe's value whole (e.g.
    `ray`, for a variant whose placement drops the base's role resources)."""
    import yaml

    def merge(under, over):
        if isinstance(under, dict) and isinstance(over, dict):
            return {**under, **{k: merge(under[k], v) if k in under else v for k, v in over.items()}}
        return over

    under, over = yaml.safe_load(base) or {}, yaml.safe_load(recipe) or {}
    merged = merge(under, over)
    merged.update({k: over[k] for k in replace if k in over})
    return yaml.safe_dump(merged, sort_keys=False)


def run_job(config):
    """A recipe's `main`: the job, on Ray."""
    from marinrl.job.rl_job import RLJob

    return RLJob(config).run()


def _split_dry_run(argv: Sequence[str]) -> tuple[bool, dict, list[str]]:
    """(whether --dry_run is there, its --dry_run.<field> values, the job's own flags)."""
    dry, shapes, rest = False, {}, []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == DRY_RUN_FLAG:
            dry = True
        elif arg.startswith(DRY_RUN_FLAG + "."):
            name, _, value = arg[len(DRY_RUN_FLAG) + 1:].partition("=")
            if not value:
                if i + 1 >= len(args):
                    raise SystemExit(f"{arg} needs a value")
                i, value = i + 1, args[i + 1]
            shapes[name] = value
        else:
            rest.append(arg)
        i += 1
    return dry, shapes, rest


def parse_recipe(recipe_yaml: str, argv: Sequence[str]):
    """The recipe's `RLJobConfig`: its YAML with `argv`'s flags over it (draccus)."""
    import draccus

    from marinrl.job.rl_job import RLJobConfig

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(recipe_yaml)
        path = f.name
    try:
        return draccus.parse(RLJobConfig, config_path=path, args=list(argv))
    finally:
        os.unlink(path)


def dry_run_shapes(values: dict, defaults):
    """`DryRunShapes` from the recipe's defaults and `--dry_run.<field>` flags, naming an unknown field."""
    from marinrl.dry_run import DryRunShapes

    names = {f.name for f in dataclasses.fields(DryRunShapes)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise SystemExit(f"--dry_run.{unknown[0]}: unknown; the dry run's fields are {', '.join(sorted(names))}")
    try:
        return dataclasses.replace(defaults, **{k: int(v) for k, v in values.items()})
    except ValueError as e:
        raise SystemExit(f"--dry_run: {e}") from None


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def _use_fake_cpu_devices(n: int) -> None:
    """This process's JAX gets `n` CPU devices; re-executes it when its backend has started already."""
    if os.environ.get(_CHILD_ENV) == str(n):
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"]), "JAX_PLATFORMS": "cpu",
           _CHILD_ENV: str(n)}
    os.environ.update(env)
    if _backend_started():  # too late for this process: start it again with the environment set
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *sys.argv])


def run_recipe(main: Callable, recipe_yaml: str, *, dry_run_defaults=None, argv: Optional[Sequence[str]] = None):
    """A recipe's `__main__`: parse the config (YAML + flags), then `main(config)` or the dry run."""
    from marinrl.config.errors import ConfigError

    dry, shape_values, job_args = _split_dry_run(sys.argv[1:] if argv is None else argv)
    config = parse_recipe(recipe_yaml, job_args)
    if not dry:
        return main(config)

    from marinrl.dry_run import DryRunShapes, dry_run

    shapes = dry_run_shapes(shape_values, dry_run_defaults or DryRunShapes())
    try:
        config.validate()
    except ConfigError as e:
        raise SystemExit(f"--dry_run: {e}") from None
    from marinrl.dry_run import trainer_devices

    _use_fake_cpu_devices(trainer_devices(config))
    report = dry_run(config, shapes)
    for line in report.lines():
        print(line, flush=True)
    print("[dry run] json " + json.dumps(report.as_dict()), flush=True)
    return report
