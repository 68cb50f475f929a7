"""`marinrl export-peft CONFIG --out DIR [--policy NAME] [--checkpoint PATH]`: a `lora` policy's adapters in
PEFT's layout (docs/policies.md, "Export to PEFT").

Every input is checked before an adapter is read: the job config, the policy (one of the job's, trained as
`lora`), the checkpoint (a trainer's, intact), the output folder (not holding an adapter already)."""

from __future__ import annotations

import argparse

from marinrl.cli.errors import InputError, config_input_error


def _policy_model(job, name: str | None):
    """The policy model of `--policy` (default: the job's only LoRA one), or an InputError naming the flag or
    the field that makes it no LoRA policy."""
    from marinrl.config.policies import policy_models, policy_names

    models = policy_models(job)
    adapted = [m for m in models if m.lora is not None]
    if name is None:
        if len(adapted) == 1:
            return adapted[0]
        if not adapted:
            raise InputError("the job trains no LoRA adapters (no `lora:` and no policy with `specialization: lora`): "
                             "its checkpoints hold whole models, which a Hugging Face checkpoint exports")
        raise InputError(f"--policy: the job has {len(adapted)} lora policies ("
                         f"{', '.join(m.name for m in adapted)}): name the one to export")
    if name not in policy_names(job):
        raise InputError(f"--policy {name!r}: the job defines no such policy (it has "
                         f"{', '.join(repr(n) for n in policy_names(job))})")
    (model,) = [m for m in models if name in m.policies]
    if model.lora is None:
        spec = job.policies[name].specialization if name in job.policies else "shared"
        field = f"policies.{name}.specialization" if name in job.policies else "lora"
        raise InputError(f"--policy {name!r} is not a lora policy ({field}: {spec}): its checkpoints hold every "
                         "weight, not adapters")
    return model


def run(args: argparse.Namespace) -> int:
    from marinrl.config.errors import ConfigError, ConfigInputError, load_job_config
    from marinrl.config.job import RLJobConfig

    try:
        job = load_job_config(RLJobConfig, args.config, [])
        job.validate()
    except (ConfigInputError, ConfigError, ValueError) as e:
        raise config_input_error(args.config, [], e) from e
    model = _policy_model(job, args.policy)

    import fsspec

    from marinrl.models.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    fs, out = fsspec.core.url_to_fs(args.out)
    taken = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if fs.exists(f"{out.rstrip('/')}/{f}")]
    if taken and not args.overwrite:
        raise InputError(f"--out {args.out} already holds {taken[0]}: choose another folder, or --overwrite")

    from marinrl.config.policies import trainers
    from marinrl.eval import resolve_checkpoint  # Levanter: seconds

    (trainer,) = [t for t in trainers(job) if model in t.models]  # the adapters of one base: one trainer's slots
    slot = (trainer.adapters.index(model), len(trainer.adapters)) if trainer.adapters else None
    source = args.checkpoint or f"{trainer.run_dir}/checkpoints"
    try:
        checkpoint = resolve_checkpoint(source)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"{'--checkpoint' if args.checkpoint else f'policy {model.name!r}'}: {e}") from e
    if checkpoint.kind != "levanter":
        raise InputError(f"--checkpoint {source} is a Hugging Face checkpoint (config.json): give a trainer "
                         f"checkpoint of policy {model.name!r} (a step-N folder, or its checkpoints/ folder)")

    from marinrl.models.peft_export import AdapterLoadError, export_peft

    try:
        result = export_peft(checkpoint.path, model.model, model.lora, args.out,
                             base_model_name_or_path=args.base_model, slot=slot)
    except AdapterLoadError as e:
        raise InputError(str(e)) from e
    except (FileNotFoundError, ValueError) as e:  # the base's config.json, a family not exported
        raise InputError(f"model of policy {model.name!r}: {e}") from e
    base = result.config["base_model_name_or_path"]
    print(f"[marinrl] policy {model.name!r}, {checkpoint.path} (weight step {checkpoint.weight_step}): "
          f"{result.tensors} adapter arrays ({result.nbytes / 1e6:.2f} MB, rank {model.lora.rank}, "
          f"alpha {model.lora.alpha:g}, modules {', '.join(result.config['target_modules'])}) -> {args.out}")
    if base is None:
        print("[marinrl] the base is a model built from a seed or a Levanter checkpoint: adapter_config.json names "
              "none (--base-model NAME sets it); load the adapters onto that base exported as a Hugging Face model")
    return 0


def add_parser(sub) -> None:
    """The `export-peft` subcommand's arguments."""
    p = sub.add_parser("export-peft", help="write a lora policy's adapters in PEFT's layout (adapter_config.json, "
                                           "adapter_model.safetensors)",
                       description="Export the adapters of a `lora` policy's trainer checkpoint as PEFT loads them "
                                   "(peft.PeftModel.from_pretrained(base, OUT)). See docs/policies.md.")
    p.add_argument("config", help="the job's config (RLJobConfig YAML): the policy's model and lora block")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (local or any fsspec URL)")
    p.add_argument("--policy", metavar="NAME", help="the lora policy to export (default: the job's only one)")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="a step-N folder or a checkpoints/ folder (newest intact step); default: the policy's "
                        "<run_dir>/checkpoints (<run_dir>/policies/<name>/checkpoints next to other policies)")
    p.add_argument("--base-model", metavar="NAME_OR_PATH",
                   help="adapter_config.json's base_model_name_or_path (default: the model's hf_checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace adapter files already in --out")
    p.set_defaults(run=run)
