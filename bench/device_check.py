"""The device check: what the first GPU node or TPU VM says about marinrl, in one run of at most 8 minutes.

Run it wherever a device is at hand (docs/device_check.md records each result):

    python bench/device_check.py --plan        # what it would run, and whether it can (any machine, seconds)
    python bench/device_check.py               # the check: one JSON line at the end (also --out FILE)

Each section runs in a process of its own (so a crash, a hang or a device's memory peak stays in it) under
the time left of `--budget_s`; a section that cannot start or fails says why in its entry, and the others
still run:

- `env`: JAX's backend, version and devices (kind, TPU coordinates), each device's memory limit, the CPU.
- `two_processes`: two JAX processes sharing the device, each started with the environment the job gives
  an actor (`marinrl.job.placement.actor_env`): on a GPU the shared mode (`num_gpus: 0`, trainer 0.45 and
  rollout 0.3 of its memory); on a TPU host each candidate environment for a host split between two
  processes (docs/scaling.md, "One host"), so the first lent TPU says which one libtpu accepts.
  Each process allocates and multiplies while the other holds its memory.
- `train_step`: the Qwen3-0.6B recipe's model at its real size (random weights) through Levanter's Trainer
  and the job's loss, on one device, at the recipe's row length and microbatch: step seconds, trained
  tokens/s, MFU (the dry run's model FLOPs over the chip's peak, `marinrl.dry_run.flops.chip_peak_flops`)
  and the device's measured peak (`memory_stats()`) against the dry run's prediction for the same config.
  `train_step_no_remat`: the same with gradient checkpointing off; `train_step_auto`: the recipe's
  `gradient_checkpointing` and `per_device_parallelism` (`auto`) as the trainer resolves them from this device's
  memory, with its attention (`model.model.attn_backend`), over 32 rows: the choice's lines in the JSON.
- `generation`: the same model behind the job's inference server (Levanter's engine, the recipe's engine
  sizes) on one device: a batch of prompts × samples, tokens/s, the measured peak and the prediction.
- `quickstart`: experiments/quickstart.py with both roles on the device (the shared mode above): whether it
  learns, and how long it takes. Needs Ray.

`--sections` picks some; `--steps`, `--rows`, `--prompt_tokens`, `--new_tokens` change the shapes. An image
whose JAX is newer than our pin runs through `bench/device_compat` (a shim for one symbol Haliax still uses);
the JSON says when it did.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_BENCH = pathlib.Path(__file__).resolve().parent
_REPO = _BENCH.parent
sys.path.insert(0, str(_REPO / "src"))  # the repo's code, installed or not (a device image has no venv of ours)
RESULT_TAG = "DEVICE_CHECK_RESULT "
SECTIONS = ("env", "two_processes", "train_step", "train_step_no_remat", "train_step_auto", "generation",
            "quickstart")
SECTION_S = {"env": 60, "two_processes": 90, "train_step": 180, "train_step_no_remat": 180, "train_step_auto": 180,
             "generation": 200, "quickstart": 300}
"""A section's own time limit (seconds), before the budget's."""
RECIPES = {"gpu": "grpo_math_qwen3_0p6b_one_gpu_node.py", "tpu": "grpo_math_qwen3_0p6b_one_tpu_host.py",
           "cpu": "grpo_math_qwen3_0p6b_one_gpu_node.py"}
"""The recipe whose model and shapes a section runs, by JAX backend (the CPU runs the GPU node's, scaled)."""
SHARED_GPU = {"trainer": 0.45, "rollout": 0.3}
"""`ray.<role>.memory_fraction` of the shared-GPU mode the two-process and quickstart sections run."""
TPU_SPLIT_CANDIDATES = ("jax_tests", "with_process_addresses")
"""Environments for two processes on one TPU host: `jax_tests` is what `actor_env` gives (JAX's multi-process
tests); `with_process_addresses` adds what vLLM's TPU backend sets (`TPU_PROCESS_ADDRESSES`, `CLOUD_TPU_TASK_ID`)."""


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="store_true", help="print what would run and check that it can; run nothing")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--budget_s", type=float, default=480.0, help="the whole run's wall-clock budget")
    p.add_argument("--steps", type=int, default=5, help="train steps (the first compiles; medians over the rest)")
    p.add_argument("--rows", type=int, default=None, help="rows per train step (default: the recipe's microbatch × 2)")
    p.add_argument("--prompt_tokens", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=None, help="default: the recipe's max_tokens")
    p.add_argument("--prompts", type=int, default=16, help="generation: prompts per batch")
    p.add_argument("--samples", type=int, default=16, help="generation: samples per prompt")
    p.add_argument("--inference_backend", default=None, choices=["scan", "engine"],
                   help="generation: the sampler to serve with (default: the recipe's inference.backend)")
    p.add_argument("--scale", default=None, choices=["full", "small", "tiny"],
                   help="model size (default: full on an accelerator, tiny on a CPU)")
    p.add_argument("--section_s", action="append", default=[], metavar="NAME=S",
                   help="a section's own time limit instead of SECTION_S's (repeatable), e.g. generation=400")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child process runs one section
    p.add_argument("--candidate", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    p.add_argument("--section_timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # the quickstart's, from the env section
    args = p.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: {', '.join(unknown)} not among {', '.join(SECTIONS)}")
    args.limits = dict(SECTION_S)
    for item in args.section_s:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS:
            p.error(f"--section_s {item}: {name!r} not among {', '.join(SECTIONS)}")
        try:
            args.limits[name] = float(seconds)
        except ValueError:
            p.error(f"--section_s {item}: {seconds!r} is not a number of seconds")
    return args


# ------------------------------------------------------------------------------------------ the parent


def child_env(extra: dict | None = None) -> dict:
    """The environment of a section's process: the repo's code first, and the JAX shim on an image whose JAX
    is newer than Haliax knows (bench/device_compat/sitecustomize.py), so Ray's workers get it too."""
    env = dict(os.environ)
    paths = [str(_REPO / "src"), str(_BENCH / "device_compat")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("WANDB_MODE", "offline")
    env.update(extra or {})
    return env


def run_child(argv: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """One section's process: its result line, or why there is none."""
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                              timeout=max(1.0, timeout_s), env=env or child_env(), cwd=_REPO)
    except subprocess.TimeoutExpired as e:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

        partial = [ln for ln in text(e.stdout).splitlines() if ln.startswith(RESULT_TAG)]
        return {**(json.loads(partial[-1][len(RESULT_TAG):]) if partial else {}),  # what it had measured
                "ok": False, "error": f"timed out after {timeout_s:.0f} s",
                "log_tail": (text(e.stdout)[-1000:] + "\n" + text(e.stderr)[-2500:]).strip(),
                "wall_s": round(time.monotonic() - started, 1)}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result.setdefault("wall_s", round(time.monotonic() - started, 1))
            return result
    return {"ok": False, "error": f"exit {proc.returncode} without a result",
            "log_tail": (proc.stdout[-1000:] + "\n" + proc.stderr[-2500:]).strip(),
            "wall_s": round(time.monotonic() - started, 1)}


def plan(args) -> dict:
    """What the check would run here and whether it can: no JAX backend is started."""
    problems, notes = [], []
    for module in ("jax", "levanter", "haliax", "draccus"):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module} is not importable")
    has_ray = importlib.util.find_spec("ray") is not None
    sections = args.sections.split(",")
    if "quickstart" in sections and not has_ray:
        notes.append("quickstart: ray is not importable, the section will say so and be skipped")
    for name in RECIPES.values():
        if not (_REPO / "experiments" / name).exists():
            problems.append(f"experiments/{name} is missing")
    if importlib.util.find_spec("jax") is not None:
        import jax

        if not hasattr(jax.core, "is_constant_dim"):
            notes.append(f"JAX {jax.__version__} lacks jax.core.is_constant_dim: bench/device_compat's shim "
                         "will provide it")
    budget = sum(args.limits[s] for s in sections)
    if budget > args.budget_s:
        notes.append(f"the sections' own limits add up to {budget} s, over --budget_s {args.budget_s:.0f}: later "
                     "sections get what is left")
    return {"plan": True, "ok": not problems, "sections": {s: args.limits[s] for s in sections},
            "budget_s": args.budget_s, "problems": problems, "notes": notes, "python": sys.version.split()[0]}


def main(args) -> dict:
    if args.plan:
        return plan(args)
    deadline = time.monotonic() + args.budget_s
    passthrough = [f"--steps={args.steps}", f"--prompt_tokens={args.prompt_tokens}", f"--prompts={args.prompts}",
                   f"--samples={args.samples}"]
    passthrough += [f"--rows={args.rows}"] * (args.rows is not None)
    passthrough += [f"--new_tokens={args.new_tokens}"] * (args.new_tokens is not None)
    passthrough += [f"--scale={args.scale}"] * (args.scale is not None)
    passthrough += [f"--inference_backend={args.inference_backend}"] * (args.inference_backend is not None)
    result: dict = {"device_check": 1, "sections": {}}
    for section in args.sections.split(","):
        left = deadline - time.monotonic()
        if left < 20:
            result["sections"][section] = {"ok": False, "error": f"skipped: {left:.0f} s of the budget left"}
            continue
        started = time.monotonic()
        if section == "two_processes":
            try:
                out = two_processes(result["sections"].get("env", {}), min(args.limits[section], left))
            except Exception as e:
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
        else:
            limit = min(args.limits[section], left)
            extra = []
            if section == "quickstart":  # its process must not start JAX: the quickstart's actors take the device
                backend = result["sections"].get("env", {}).get("backend")
                if backend is None:  # the env section was not asked for, or failed: ask a process of its own
                    backend = run_child(["--section=env"], min(args.limits["env"], limit / 3)).get("backend")
                    limit = min(args.limits[section], deadline - time.monotonic())
                extra = [f"--backend={backend}"]
            out = run_child([f"--section={section}", f"--section_timeout={limit}", *passthrough, *extra], limit)
        out.setdefault("wall_s", round(time.monotonic() - started, 1))
        result["sections"][section] = out
        print(f"[device_check] {section}: {'ok' if out.get('ok') else 'FAILED'} in {out['wall_s']} s"
              + ("" if out.get("ok") else f": {out.get('error')}"), flush=True)
    result["ok"] = all(s.get("ok") for s in result["sections"].values())
    return result


def two_processes(env_section: dict, timeout_s: float) -> dict:
    """Two processes on the device at once, with the environment each role's actor gets; on a TPU host, one
    pair per candidate environment."""
    from marinrl.config.placement import PlacementConfig
    from marinrl.job.placement import actor_env

    backend = env_section.get("backend", "unknown")
    if backend == "tpu":
        chips = max(1, env_section.get("device_count", 2) // 2)
        candidates = {}
        for name in TPU_SPLIT_CANDIDATES:
            pair = [actor_env(PlacementConfig(tpu_chips=chips), slot) for slot in (0, 1)]
            pair = [{**e, "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in range(slot * chips, (slot + 1) * chips))}
                    for slot, e in enumerate(pair)]
            if name == "with_process_addresses":
                pair = [{**e, "TPU_PROCESS_ADDRESSES": f"localhost:{e['TPU_PROCESS_PORT']}", "CLOUD_TPU_TASK_ID": "0"}
                        for e in pair]
            candidates[name] = pair
    else:
        candidates = {"shared_gpu" if backend == "gpu" else "cpu": [
            actor_env(PlacementConfig(memory_fraction=SHARED_GPU[role]), slot)
            for slot, role in enumerate(("trainer", "rollout"))]}
    out: dict = {"ok": True, "backend": backend, "candidates": {}}
    for name, pair in candidates.items():
        with tempfile.TemporaryDirectory(prefix="marinrl-device-pair-") as rendezvous:
            procs = [subprocess.Popen(
                [sys.executable, __file__, "--section=pair_member", f"--rank={rank}", f"--rendezvous={rendezvous}",
                 f"--candidate={name}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=child_env(env), cwd=_REPO) for rank, env in enumerate(pair)]
            members = []
            for rank, proc in enumerate(procs):
                try:
                    stdout, stderr = proc.communicate(timeout=max(5.0, timeout_s / len(candidates)))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)]
                members.append(json.loads(lines[-1][len(RESULT_TAG):]) if lines else
                               {"ok": False, "error": f"exit {proc.returncode}", "log_tail": stderr[-1500:],
                                "env": pair[rank]})
        ok = all(m.get("ok") for m in members)
        out["candidates"][name] = {"ok": ok, "members": members}
        out["ok"] = out["ok"] and ok
    return out


# ------------------------------------------------------------------------------------------ the sections


def _progress(message: str) -> None:
    """A line on stderr: what a section was doing when its time ran out shows in the parent's `log_tail`."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _emit(result: dict) -> None:
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)


def _device_peak() -> dict:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return {"peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None,
            "limit_gib": stats.get("bytes_limit", 0) / 2**30 if stats else None}


def section_env(args) -> dict:
    import jax

    sys.path.insert(0, str(_BENCH))
    from machine import machine

    devices = jax.devices()
    return {"ok": True, "backend": jax.default_backend(), "jax": jax.__version__, "device_count": len(devices),
            "process_count": jax.process_count(),
            "devices": [{"id": d.id, "kind": d.device_kind, "coords": getattr(d, "coords", None)} for d in devices],
            "memory": _device_peak(), "machine": machine(), "jax_shim": _shimmed(),
            "ray": importlib.util.find_spec("ray") is not None}


def _shimmed() -> bool:
    return bool(os.environ.get("MARINRL_JAX_SHIM"))


def section_pair_member(args) -> dict:
    """One of two processes sharing the device: allocate and multiply, then wait (bounded) for the other."""
    import jax
    import jax.numpy as jnp

    devices = jax.local_devices()
    x = jax.random.normal(jax.random.PRNGKey(args.rank), (4096, 4096), jnp.float32)
    y = (x @ x).block_until_ready()
    rendezvous = pathlib.Path(args.rendezvous)
    (rendezvous / f"ready-{args.rank}").write_text("1")
    other = rendezvous / f"ready-{1 - args.rank}"
    waited = time.monotonic()
    while not other.exists() and time.monotonic() - waited < 60:
        time.sleep(0.1)
    env = {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "CUDA_VISIBLE", "XLA_PYTHON",
                                                                 "ALLOW_MULTIPLE", "CLOUD_TPU"))}
    return {"ok": other.exists() and bool(jnp.isfinite(y).all()), "rank": args.rank, "candidate": args.candidate,
            "devices": [f"{d.device_kind}:{d.id}" for d in devices], "saw_other": other.exists(),
            "memory": _device_peak(), "env": env}


def _recipe_job(backend: str, overlay: list[str]):
    import runpy

    from marinrl.recipe import parse_recipe

    recipe = runpy.run_path(str(_REPO / "experiments" / RECIPES[backend]), run_name="recipe")["RECIPE"]
    return parse_recipe(recipe, overlay)


def _scale_overlay(scale: str) -> list[str]:
    if scale == "full":
        return []
    small = {"small": dict(hidden_dim=256, intermediate_dim=768, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=64, vocab=4096),
             "tiny": dict(hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=2, num_kv_heads=2,
                          head_dim=32, vocab=512)}[scale]
    vocab = small.pop("vocab")
    return [f"--model.model.{k}={v}" for k, v in small.items()] + [f"--model.vocab_size={vocab}"]


def _job_for_section(args, backend: str, rows: int | None = None, extra: tuple = ()):
    """The recipe's job on one device, random weights, at this check's scale (`extra`: more overrides)."""
    scale = args.scale or ("full" if backend in ("gpu", "tpu") else "tiny")
    devices = "--ray.trainer.num_gpus=1" if backend == "gpu" else (
        "--ray.trainer.tpu_chips=1" if backend == "tpu" else "--ray.trainer.num_gpus=0")
    overlay = ["--model.hf_checkpoint=null", f"--run_root={tempfile.mkdtemp(prefix='marinrl-device-check-')}",
               devices, "--n_rollout_workers=1", *_scale_overlay(scale), *extra]
    if getattr(args, "inference_backend", None):
        overlay.append(f"--inference.backend={args.inference_backend}")
    job = _recipe_job(backend, overlay)
    per_device = job.trainer.per_device_parallelism
    auto = per_device == "auto"  # left for the trainer to choose, over twice its usual microbatch of 16
    if auto or per_device is None or per_device <= 0:
        per_device = 16 if auto else 4
    rows = rows or args.rows or 2 * per_device
    job = _recipe_job(backend, overlay + [f"--groups_per_step={max(1, rows // job.n_generations)}"]
                      + ([] if auto else [f"--trainer.per_device_parallelism={min(per_device, rows)}"]))
    from marinrl.config.trainer import JsonLoggerTracker

    # metrics to the JSON log only: a device image need not have wandb, and the check logs nothing anyway
    job = dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, tracker=JsonLoggerTracker()))
    return job, scale


def section_train_step(args, remat: bool | None = True) -> dict:
    """The recipe's train step with gradient checkpointing on (`remat`), off, or None: the recipe's settings as the
    trainer resolves them on this device (`gradient_checkpointing` and `per_device_parallelism: auto`)."""
    import functools

    import haliax as hax
    import jax
    import levanter
    import numpy as np
    from levanter.trainer import Trainer

    from marinrl.dry_run import predicted_memory
    from marinrl.dry_run.flops import ModelDims, chip_peak_flops, recomputed_forward_passes, train_flops
    from marinrl.dry_run.memory import default_response_tokens, resolve_update_memory, train_row_length
    from marinrl.dry_run.working_set import trainer_attention
    from marinrl.job.plan import local_device_bytes, train_worker_config
    from marinrl.levanter_configs import to_levanter
    from marinrl.models.policy_model import build_model
    from marinrl.train.batching import make_training_batch, row_alignment
    from marinrl.train.worker import StepInput, _step_loss

    backend = jax.default_backend()
    setting = () if remat is None else (f"--model.model.gradient_checkpointing={str(remat).lower()}",)
    job, scale = _job_for_section(args, backend, extra=setting)
    job, choice = resolve_update_memory(job, local_device_bytes(), cpu=backend == "cpu")  # as the trainer does
    response = args.new_tokens or default_response_tokens(job)
    length = train_row_length(job, args.prompt_tokens, response)
    rows = job.groups_per_step * job.n_generations
    cfg = train_worker_config(job)
    trainer_cfg = dataclasses.replace(cfg.trainer, num_train_steps=args.steps + 1)
    levanter.initialize(trainer_cfg)
    predicted = predicted_memory(job, "trainer", 1, prompt_tokens=args.prompt_tokens, response_tokens=response,
                                 cpu=backend == "cpu")
    rng = np.random.default_rng(0)
    vocab = job.model.vocab_size
    batches = []
    for step in range(args.steps):
        rollouts, advantages = _synthetic_step(rng, step, job.groups_per_step, job.n_generations,
                                               args.prompt_tokens, response, vocab)
        batches.append(make_training_batch(rollouts, advantages, batch_size=rows, config=job.batching,
                                           **row_alignment(trainer_cfg)))
    times = []
    _progress(f"train_step: {rows} rows of up to {length} tokens, microbatch {job.trainer.per_device_parallelism}")
    optimizer = cfg.optimizer.build(trainer_cfg.num_train_steps)
    with Trainer(trainer_cfg, optimizer, functools.partial(_step_loss, config=job.loss),
                 add_default_hooks=False) as trainer:
        state = trainer.initial_state(jax.random.PRNGKey(0), model_init=lambda: build_model(job.model))
        _progress("train_step: initial state built")
        reference = build_model(job.model) if job.loss.uses_reference else None
        ref_fn = hax.named_jit(_token_logprobs(), axis_resources=trainer.compute_axis_mapping)
        for batch in batches:
            batch = hax.shard(batch, trainer.compute_axis_mapping)
            t0 = time.perf_counter()
            ref = ref_fn(reference, batch) if reference is not None else None
            info = trainer.train_step(state, StepInput(batch, ref))
            jax.block_until_ready(info.state.model)
            times.append(time.perf_counter() - t0)
            _progress(f"train_step: step {len(times)} in {times[-1]:.2f} s, loss {float(info.loss):.4f}")
            state = info.state
            if not np.isfinite(info.loss):
                return {"ok": False, "error": f"loss {info.loss} at step {len(times)}"}
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    arch = to_levanter(job.model.model)
    dims = ModelDims.of(arch, vocab)
    flops = train_flops(dims, rows, max(b.Pos.size for b in batches),
                        recomputed_forward_passes(getattr(arch, "gradient_checkpointing", False)))
    trained = statistics.median(float(np.asarray(b.loss_mask.array).sum()) for b in batches)
    peak = _device_peak()
    chip = jax.devices()[0].device_kind
    peak_flops = chip_peak_flops(chip)
    ref_flops = flops.model * (1 + 1 / 3 * (reference is not None))  # the reference's forward: one more pass
    return {"ok": True, "backend": backend, "chip": chip, "scale": scale, "rows": rows, "row_length": length,
            "gradient_checkpointing": str(getattr(arch, "gradient_checkpointing", None)),
            "positions": sorted({b.Pos.size for b in batches}), "microbatch_rows": job.trainer.per_device_parallelism,
            "attention": trainer_attention(job, cpu=backend == "cpu"),
            "update_memory_choice": choice.lines() if choice is not None else None,
            "mp": str(job.trainer.mp), "steps": len(times), "first_step_s": times[0], "step_s": step_s,
            "trained_tokens_per_s": trained / step_s, "model_flops": flops.model, "executed_flops": flops.executed,
            "mfu": (ref_flops / step_s / peak_flops) if peak_flops else None,
            "chip_peak_flops": peak_flops, "measured": peak,
            "predicted_peak_gib": predicted.peak_bytes_per_device / 2**30,
            "predicted": {k: v / 2**30 for k, v in predicted.bytes_per_device.items()},
            "peak_ratio": (peak["peak_gib"] / (predicted.peak_bytes_per_device / 2**30)) if peak["peak_gib"] else None,
            "jax_shim": _shimmed()}


def _token_logprobs():
    from marinrl.train.losses import token_logprobs

    return token_logprobs


def _synthetic_step(rng, step: int, prompts: int, samples: int, prompt_tokens: int, response_tokens: int, vocab: int):
    """One step's groups of random tokens at full length (a random-init model's rollouts), 0/1 rewards."""
    import uuid

    import numpy as np

    from marinrl.train.advantages import group_advantages
    from marinrl.types import Rollout, RolloutMetadata

    rollouts, advantages = [], []
    for _ in range(prompts):
        prompt = rng.integers(2, vocab, prompt_tokens)
        rewards = rng.integers(0, 2, samples).astype(np.float64)
        group_id = uuid.UUID(int=int(rng.integers(0, 2**62))).hex
        for reward in rewards:
            tokens = rng.integers(2, vocab, response_tokens)
            logprobs = np.minimum(-np.log(vocab) + 0.25 * rng.standard_normal(response_tokens), 0).astype(np.float32)
            rollouts.append(Rollout(
                prompt_tokens=prompt, response_tokens=tokens, response_logprobs=logprobs, temperature=1.0,
                loss_mask=np.ones(response_tokens, dtype=bool),
                token_rewards=np.where(np.arange(response_tokens) == response_tokens - 1, reward, 0).astype(np.float32),
                episode_reward=float(reward), finish_reason="length", env_name="device_check",
                lesson_id="device_check", group_id=group_id, metadata=RolloutMetadata("device_check", step, 0.0)))
        advantages.extend(group_advantages(rewards, "group_std"))
    return rollouts, np.asarray(advantages)


def section_generation(args) -> dict:
    import jax
    import numpy as np

    from marinrl.dry_run import predicted_memory
    from marinrl.dry_run.engine_cache import RolloutDevice
    from marinrl.dry_run.flops import ModelDims, generation_flops
    from marinrl.dry_run.memory import default_response_tokens
    from marinrl.inference.context import SamplingParams
    from marinrl.job.plan import serve
    from marinrl.levanter_configs import to_levanter
    from marinrl.models.policy_model import build_model, build_tokenizer

    backend = jax.default_backend()
    job, scale = _job_for_section(args, backend)
    response = args.new_tokens or default_response_tokens(job)
    inference = dataclasses.replace(job.inference, serve_http=False, model_axis_size=1)
    job = dataclasses.replace(job, inference=inference)
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    device = RolloutDevice(backend if backend in ("gpu", "tpu") else "cpu", jax.local_devices()[0].device_kind,
                           float(limit) if limit and backend != "cpu" else None)
    predicted = predicted_memory(job, "rollout", 1, prompt_tokens=args.prompt_tokens, response_tokens=response,
                                 cpu=backend == "cpu", device=device)
    model = build_model(job.model, dtype=job.rollout_dtype())
    _progress(f"generation: model built; engine {inference.engine}")
    server_s = time.perf_counter()
    server = serve(inference, model, build_tokenizer(job.model))
    server_s = time.perf_counter() - server_s
    _progress(f"generation: server ready in {server_s:.1f} s")
    rng = np.random.default_rng(0)
    dims = ModelDims.of(to_levanter(job.model.model), job.model.vocab_size)
    out = {"ok": False, "backend": backend, "scale": scale, "backend_kind": inference.backend,
           "dtype": job.rollout_dtype(), "server_s": server_s, "jax_shim": _shimmed(),
           "predicted_peak_gib": predicted.peak_bytes_per_device / 2**30,
           "predicted": {k: v / 2**30 for k, v in predicted.bytes_per_device.items()},
           "predicted_notes": list(predicted.notes)}
    try:
        for name, (prompts, samples, prompt_tokens, new_tokens) in generation_batches(args, response).items():
            out[name] = batch = {"prompts": prompts, "samples": samples, "rows": prompts * samples,
                                 "prompt_tokens": prompt_tokens, "max_new_tokens": new_tokens}
            sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens)
            if inference.backend == "scan":
                batch.update(_scan_roofline(server, prompts, samples, prompt_tokens, new_tokens))
            for call in ("first", "second"):  # the first compiles (or reuses the compile of an earlier batch)
                prompt_ids = rng.integers(2, 256, (prompts, prompt_tokens)).tolist()
                t0 = time.perf_counter()
                gens = server.generate(prompt_ids, samples, sampling, seed=len(call))
                batch[f"{call}_call_s"] = time.perf_counter() - t0
                batch["tokens"] = sum(len(g.tokens) for row in gens for g in row)
                _progress(f"generation: {name} batch, {call} call: {batch['tokens']} tokens in "
                          f"{batch[f'{call}_call_s']:.1f} s")
                _emit({**out, "partial": True})  # what a timeout leaves: the batches so far
            batch["compile_s"] = batch["first_call_s"] - batch["second_call_s"]  # the first call's extra time
            batch["gen_tokens_per_s"] = batch["tokens"] / batch["second_call_s"]
            batch["s_per_new_token"] = batch["second_call_s"] / new_tokens  # ~ a decode step at this width
            if batch.get("roofline_tokens_per_s"):
                batch["roofline_fraction"] = batch["gen_tokens_per_s"] / batch["roofline_tokens_per_s"]
            batch["generation_flops_budget"] = generation_flops(dims, prompts, samples, prompt_tokens,
                                                                new_tokens).total
    finally:
        server.shutdown()
    peak = _device_peak()
    out.update(ok=True, measured=peak, **{k: out["large"][k] for k in (
        "prompts", "samples", "prompt_tokens", "max_new_tokens", "tokens", "gen_tokens_per_s") + tuple(
        k for k in ("calls", "rows_per_call", "roofline_tokens_per_s", "roofline_fraction") if k in out["large"])},
        first_call_s=out["large"]["first_call_s"], call_s=out["large"]["second_call_s"],
        peak_ratio=(peak["peak_gib"] / out["predicted_peak_gib"]) if peak["peak_gib"] else None)
    return out


def _scan_roofline(server, prompts: int, samples: int, prompt_tokens: int, new_tokens: int) -> dict:
    """The scan sampler's split of a batch (`calls`, `rows_per_call`) and its decode roofline on this device: the
    bytes a step reads (`scan_plan.decode_bytes_per_step`) over the chip's bandwidth (`chip_memory_bandwidth`)."""
    import jax
    import numpy as np

    from marinrl.dry_run.flops import chip_memory_bandwidth
    from marinrl.inference import sampler as scan_sampler
    from marinrl.inference import scan_plan

    model = server.model
    mesh = None if server.mesh is None else server.mesh.mesh
    plan = scan_sampler.call_plan(model, prompts, n=samples, prompt_tokens=prompt_tokens, max_tokens=new_tokens,
                                  max_cache_bytes=server.scan_cache_bytes, mesh=mesh)
    cfg = model.config
    attn = cfg.attention_config()
    itemsize = np.dtype(model.embeddings.token_embeddings.weight.dtype).itemsize
    weights = float(sum(x.nbytes for x in jax.tree_util.tree_leaves(model) if hasattr(x, "nbytes")))
    t_len = scan_plan.bucket(new_tokens, 16)
    per_step = scan_plan.decode_bytes_per_step(
        weights_bytes=weights, kv_bytes_per_token=2 * cfg.num_layers * attn.num_kv_heads * attn.head_size * itemsize,
        prompts=plan.prompts_per_call, n=samples, p_len=scan_plan.bucket(prompt_tokens, 16), t_len=t_len,
        steps=new_tokens)
    bandwidth = chip_memory_bandwidth(jax.local_devices()[0].device_kind)
    out = {"calls": plan.calls, "rows_per_call": plan.rows_per_call,
           "cache_budget_gib": server.scan_cache_bytes / 2**30, "bytes_per_step": per_step,
           "decode_windows": list(scan_plan.decode_windows(t_len))}
    if bandwidth:
        out.update(bandwidth=bandwidth, roofline_tokens_per_s=plan.rows_per_call * bandwidth / per_step)
    return out


SMALL_BATCH = (2, 4, 32, 32)
"""The generation section's first batch: prompts, samples, prompt tokens, new tokens (8 rows of 64 tokens)."""
WIDE_NEW_TOKENS = 64
"""The `wide` batch's new tokens: the recipe's rows, a few decode rounds."""


def generation_batches(args, response: int) -> dict:
    """The generation section's batches in order: `small` (`SMALL_BATCH`: its first call is the engine's compile,
    its second a short steady loop), `wide` (the recipe's rows, `--prompts` × `--samples`, for `WIDE_NEW_TOKENS`
    tokens: a decode step's cost at the recipe's width), then `large` (those rows for the recipe's `max_tokens`).
    A slow compile, a slow step and a long loop are then told apart, and a `large` batch that runs out of time
    is predicted by the `wide` one's seconds a token."""
    return {"small": SMALL_BATCH, "wide": (args.prompts, args.samples, args.prompt_tokens, WIDE_NEW_TOKENS),
            "large": (args.prompts, args.samples, args.prompt_tokens, response)}


def section_quickstart(args) -> dict:
    """The quickstart as a user runs it. This process never starts JAX (on a GPU it would hold 75% of the
    device's memory beside the job's actors): the backend is the `env` section's, passed down (`--backend`)."""
    if importlib.util.find_spec("ray") is None:
        return {"ok": False, "error": "skipped: ray is not importable here"}
    backend = args.backend
    if backend in (None, "None"):
        return {"ok": False, "error": "skipped: no backend from the env section (it failed or timed out)",
                "jax_imported": "jax" in sys.modules}
    overlay = []
    if backend == "gpu":  # both roles on the one GPU: the shared mode (docs/scaling.md, "One host")
        overlay = [f"--ray.trainer.memory_fraction={SHARED_GPU['trainer']}",
                   f"--ray.rollout.memory_fraction={SHARED_GPU['rollout']}"]
    run_id = f"device-check-{int(time.time())}"
    started = time.monotonic()
    # a session of its own, so that a timeout ends the job's Ray processes too
    proc = subprocess.Popen([sys.executable, str(_REPO / "experiments" / "quickstart.py"), "--run_id", run_id,
                             *overlay], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=_REPO,
                            env=child_env(), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=max(10.0, args.section_timeout - 15))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return {"ok": False, "error": f"timed out after {time.monotonic() - started:.0f} s",
                "log_tail": log[-2500:]}
    summary_path = _REPO / "runs" / run_id / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"ok": proc.returncode == 0, "backend": backend, "exit": proc.returncode,
            "wall_s": time.monotonic() - started, "overlay": overlay, "jax_imported": "jax" in sys.modules,
            **{k: summary.get(k) for k in ("steps", "seconds", "median_step_s", "eval_reward_start",
                                            "eval_reward_end", "rollouts_written", "rollout_worker_restarts")},
            "log_tail": None if proc.returncode == 0 else log[-2500:]}


def run_section(args) -> dict:
    fn = {"env": section_env, "pair_member": section_pair_member, "train_step": section_train_step,
          "train_step_no_remat": lambda a: section_train_step(a, remat=False),
          "train_step_auto": lambda a: section_train_step(a, remat=None),
          "generation": section_generation, "quickstart": section_quickstart}[args.section]
    try:
        return fn(args)
    except Exception as e:  # the section's one line; the parent goes on with the others
        import traceback

        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                "traceback_tail": traceback.format_exc()[-2500:]}


if __name__ == "__main__":
    ARGS = _args()
    if ARGS.section:
        _emit(run_section(ARGS))
        sys.exit(0)
    out = main(ARGS)
    line = json.dumps(out, default=str)
    if ARGS.out:
        pathlib.Path(ARGS.out).write_text(line + "\n")
    print(line)
    sys.exit(0 if out.get("ok") else 1)
