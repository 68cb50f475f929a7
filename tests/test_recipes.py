"""Every recipe in experiments/: its config parses and validates, and its dry run (in a subprocess with the
trainer's number of fake devices) lowers the train step, compiles the engine's prefill and decode loop at
the recipe's shapes, and prints memory per role and FLOPs that hold together."""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import subprocess
import sys

import pytest
from conftest import xla_flags_without_device_count

from marinrl.config.trainer import parse_mp
from marinrl.envs.base import make_env
from marinrl.job.plan import train_worker_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = ["grpo_math_qwen3_0p6b", "grpo_math_llama3_8b_v5p", "grpo_reasoning_gym_qwen3_0p6b",
           "grpo_math_qwen3_0p6b_one_tpu_host", "grpo_math_qwen3_0p6b_one_gpu_node"]
ONE_HOST = {"grpo_math_qwen3_0p6b_one_tpu_host", "grpo_math_qwen3_0p6b_one_gpu_node"}
SCAN = {"grpo_math_qwen3_0p6b_one_gpu_node"}
"""Recipes that sample with the scan sampler: on a GPU, Levanter's engine runs its reference paged attention
(docs/device_check.md); on a TPU it has its kernel."""
"""Variants whose job runs on one machine: its own local Ray, the host's accelerators split between the roles."""


def _recipe(name: str) -> dict:
    return runpy.run_path(str(ROOT / "experiments" / f"{name}.py"), run_name="recipe")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_config_parses_and_validates(name):
    from marinrl.recipe import parse_recipe

    config = parse_recipe(_recipe(name)["RECIPE"], [])

    assert parse_mp(config.trainer.mp) == {"params": "float32", "compute": "bfloat16", "output": "bfloat16"}
    assert config.inference.backend == ("scan" if name in SCAN else "engine")
    assert config.model.model.gradient_checkpointing == "auto"  # resolved by the trainer from its device's memory
    # bf16 rollouts over the f32 master, the mismatch corrected by TIS (docs/models.md, "Dtypes")
    assert config.model.dtype == "float32" and config.rollout_dtype() == "bfloat16"
    assert train_worker_config(config).publish_dtype == "bfloat16"
    assert (config.loss.ratio_anchor, config.loss.correction) == ("recomputed", "tis")
    assert any(type(t).__name__ == "WandbTracker" for t in config.trainer.tracker)
    config.validate()  # every range, the multi-host v5p-64 trainer included


def test_recipe_yaml_merges_mappings_and_the_recipe_wins():
    from marinrl.recipe import GRPO_AT_SCALE, parse_recipe, recipe_yaml

    merged = recipe_yaml("a: {b: 1, c: [1, 2]}\nd: 3\n", "a: {c: [9]}\ne: 4\n")
    assert merged == "a:\n  b: 1\n  c:\n  - 9\nd: 3\ne: 4\n"
    for name in RECIPES:  # every recipe keeps the shared base under its own values
        config = parse_recipe(_recipe(name)["RECIPE"], [])
        assert config.optimizer.learning_rate == 1.0e-6 and config.loss.kl_beta == 0.0
        assert config.batching.min_bucket == 256 and config.max_staleness == 1
        assert config.ray.address == (None if name in ONE_HOST else "auto") and config.trainer.model_axis_size == 1
    assert "gradient_checkpointing: auto" in GRPO_AT_SCALE


def test_recipe_flags_keep_the_recipes_other_values():
    """A flag over the recipe's YAML changes that field only (draccus would rebuild a nested config from
    class defaults if the recipe's defaults were Python objects)."""
    from marinrl.recipe import parse_recipe

    yaml = _recipe("grpo_math_qwen3_0p6b")["RECIPE"]
    config = parse_recipe(yaml, ["--model.hf_checkpoint", "/ckpt", "--ray.trainer.tpu", "null",
                                 "--ray.trainer.num_gpus", "1", "--trainer.per_device_parallelism", "16"])
    assert config.model.hf_checkpoint == "/ckpt"
    assert config.model.model.hidden_dim == 1024 and config.model.vocab_size == 151936
    assert config.ray.trainer.tpu is None and config.ray.trainer.num_gpus == 1
    assert config.trainer.per_device_parallelism == 16 and config.curriculum.lessons[0].max_tokens == 768
    config.validate()  # the GPU variant the recipe documents


def test_the_reasoning_gym_recipe_is_the_0p6b_recipe_with_a_curriculum_of_generated_tasks():
    """Only the run id, the lessons and the tracker's tags differ from the GSM8K recipe; every lesson builds
    (reasoning-gym's generators: nothing to download), and each level unlocks at the one below's graduation."""
    from marinrl.recipe import parse_recipe

    gsm8k, rg = (parse_recipe(_recipe(n)["RECIPE"], [])
                 for n in ("grpo_math_qwen3_0p6b", "grpo_reasoning_gym_qwen3_0p6b"))
    assert rg.model == gsm8k.model and rg.trainer.mp == gsm8k.trainer.mp and rg.ray == gsm8k.ray
    assert rg.inference == gsm8k.inference and rg.loss == gsm8k.loss and rg.groups_per_step == gsm8k.groups_per_step
    lessons = rg.curriculum.lessons
    assert [x.lesson_id for x in lessons] == ["arith-l0", "arith-l1", "arith-l2", "countdown", "knights-knaves"]
    assert {x.env.name for x in lessons} == {"reasoning_gym"}
    for before, after in zip(lessons, lessons[1:]):
        (dep,) = after.dependencies
        assert dep.lesson_id == before.lesson_id
    pytest.importorskip("reasoning_gym")
    for lesson in lessons:
        make_env(lesson.env)


def test_one_host_variants_split_one_host_and_keep_the_rest():
    """The one-host variants are the 0.6B recipe with a local Ray and one machine's accelerators split between
    the roles (no role resources, no slice head resource), and fit that machine."""
    from marinrl.job.placement import placement_problem
    from marinrl.recipe import parse_recipe

    base = parse_recipe(_recipe("grpo_math_qwen3_0p6b")["RECIPE"], [])
    hosts = {"grpo_math_qwen3_0p6b_one_tpu_host": {"CPU": 224, "TPU": 8, "TPU-v5litepod-8-head": 1},  # a v5e-8
             "grpo_math_qwen3_0p6b_one_gpu_node": {"CPU": 208, "GPU": 8}}  # an a3-highgpu-8g
    for name, host in hosts.items():
        config = parse_recipe(_recipe(name)["RECIPE"], [])
        assert config.model == base.model and config.curriculum == base.curriculum and config.loss == base.loss
        trainer, rollout = config.ray.trainer, config.ray.rollout
        assert not trainer.resources and not rollout.resources and trainer.tpu is None and rollout.tpu is None
        node = [{"NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": host}]
        assert placement_problem(trainer, rollout, config.n_rollout_workers, node) is None
        accelerators = {"TPU": "tpu_chips", "GPU": "num_gpus"}[next(k for k in ("TPU", "GPU") if k in host)]
        used = getattr(trainer, accelerators) + config.n_rollout_workers * getattr(rollout, accelerators)
        assert used == host.get("TPU", host.get("GPU"))  # every chip or GPU of the host has a role


def _dry_run(name: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--dry_run"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[dry run] json ")]
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0][len("[dry run] json "):]), out.stdout


@pytest.mark.parametrize("name", RECIPES)
def test_dry_run(name):
    from marinrl.recipe import parse_recipe

    config = parse_recipe(_recipe(name)["RECIPE"], [])
    report, text = _dry_run(name)
    trainer, rollout = report["trainer"], report["rollout"]
    n = report["total_params"]

    # the backend the recipe runs is the one compiled: Levanter's engine (prefill, decode loop) or the scan sampler
    backend = "scan" if name in SCAN else "engine"
    assert report["backend"] == backend and f"rollout backend: {backend}" in text
    # the trainer's attention: `auto`, a flash attention on the placement's device kind
    kind = config.ray.trainer.device[0]
    assert f"; attention {'splash' if kind == 'tpu' else 'jax_flash'} (auto)" in report["trainer_settings"]
    programs = {p["name"]: p for p in report["programs"]}
    rollout_programs = ["scan sampler"] if backend == "scan" else ["engine prefill", "engine decode loop"]
    assert list(programs) == ["train step", *rollout_programs]
    assert all(programs[p]["compiled"] for p in rollout_programs)
    assert trainer["devices"] == config.ray.trainer.devices() * config.ray.trainer.hosts()
    assert rollout["devices"] == programs[rollout_programs[-1]]["devices"] == config.ray.rollout.devices()

    # trainer: float32 parameters split by FSDP over every device (up to the unsplit norms), gradients the same
    # bytes, AdamW's two moments, and the peak is their sum with the accumulator and the activations
    t = trainer["bytes_per_device"]
    assert 4 * n / trainer["devices"] <= t["parameters"] <= 4 * n / trainer["devices"] * 1.01
    assert t["gradients"] == t["parameters"] == t["gradient_accumulator"]  # microbatches: an accumulator too
    assert t["optimizer_state"] == pytest.approx(2 * t["parameters"], rel=1e-3)
    assert trainer["peak_bytes_per_device"] == pytest.approx(sum(t.values()))
    assert 0 < t["activations"]
    # rollout: bfloat16 weights (the recipes' compute dtype), tensor-parallel over the model axis
    r, model_axis = rollout["bytes_per_device"], rollout["mesh"]["model"]
    assert 2 * n / model_axis <= r["weights"] <= 2 * n / model_axis * 1.01
    assert r["cache"] > r["weights"] / 10 and rollout["peak_bytes_per_device"] == pytest.approx(sum(r.values()))

    # FLOPs: the MFU convention within its attention share of 6·N·T, the recompute on top where `auto` keeps
    # gradient checkpointing on the placement's device (the report says which, and why)
    choice = report["trainer_settings"]
    assert choice.startswith(("gradient checkpointing on (auto)", "gradient checkpointing off (auto)"))
    assert f"[dry run] trainer {choice}" in text
    tf, gf = report["train_flops"], report["generation_flops"]
    assert tf["tokens"] == report["rows"] * report["row_length"]
    assert 6 * n * tf["tokens"] * 0.5 < tf["model"] < 6 * n * tf["tokens"] * 1.5
    assert tf["executed"] == pytest.approx(tf["model"] + tf["recompute"])
    assert (tf["recompute"] > 0) == choice.startswith("gradient checkpointing on")
    rows = config.groups_per_step * config.n_generations
    assert gf["decode_tokens"] == rows * (report["response_tokens"] - 1)
    assert gf["total"] == pytest.approx(gf["prefill"] + gf["decode"]) and gf["decode"] > 10 * gf["prefill"]
