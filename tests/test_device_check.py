"""bench/device_check.py on the CPU: its plan, its two-process section through the job's own actor environment,
and the chip table MFU divides by (docs/device_check.md)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from marinrl.dry_run.flops import chip_peak_flops

REPO = pathlib.Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "device_check.py"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def test_plan_says_what_would_run_and_that_it_can():
    proc = _run("--plan", "--sections", "env,train_step", "--budget_s", "100")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["plan"] and plan["ok"] and plan["problems"] == []
    assert list(plan["sections"]) == ["env", "train_step"]
    assert any("over --budget_s 100" in note for note in plan["notes"])  # 60 + 240 s of limits


def test_an_unknown_section_is_refused_by_name():
    proc = _run("--plan", "--sections", "env,warp_drive")
    assert proc.returncode == 2 and "warp_drive" in proc.stderr


def test_two_processes_share_the_device_with_the_jobs_actor_environment(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--sections", "env,two_processes", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["sections"]["env"]["backend"] == "cpu"
    members = result["sections"]["two_processes"]["candidates"]["cpu"]["members"]
    assert [m["rank"] for m in members] == [0, 1] and all(m["saw_other"] for m in members)
    # each process had its role's share, as actor_env gives it (the shared-GPU mode's fractions)
    fractions = [m["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] for m in members]
    assert fractions == ["0.45", "0.3"]
    assert all(m["env"]["CUDA_VISIBLE_DEVICES"] == members[0]["env"]["CUDA_VISIBLE_DEVICES"] for m in members)


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
                                        ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v6 lite", 918e12),
                                        ("cpu", None)])
def test_chip_peaks_match_the_longest_name(kind, peak):
    assert chip_peak_flops(kind) == peak


def test_the_jax_shim_does_nothing_on_our_pinned_jax():
    code = ("import jax.core, os; print(os.environ.get('MARINRL_JAX_SHIM'), "
            "jax.core.is_constant_dim.__module__.startswith('jax'))")
    shim = REPO / "bench" / "device_compat"
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.stdout.split() == ["None", "True"], proc.stderr


def test_the_quickstart_section_takes_the_backend_from_the_env_section_and_never_starts_jax():
    """Its process starts the quickstart, whose actors take the device: JAX started here first would hold 75% of a
    GPU. The parent passes the env section's backend down; without one the section says so, JAX unimported."""
    proc = _run("--section=quickstart", "--backend=None", timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("DEVICE_CHECK_RESULT ")][-1]
    result = json.loads(line.split(" ", 1)[1])
    assert not result["ok"] and "no backend from the env section" in result["error"]
    assert result["jax_imported"] is False


def test_generation_runs_a_small_batch_before_the_recipes_shape():
    """8 rows of 64 tokens first (its first call times the compile, its second a short loop), then the recipe's
    rows for a few tokens, then its whole batch: a compile that never ends is told from a slow step and a long
    loop."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    args = check._args(["--prompts", "16", "--samples", "16", "--prompt_tokens", "256"])
    batches = check.generation_batches(args, 512)
    assert list(batches) == ["small", "wide", "large"]
    prompts, samples, prompt_tokens, new_tokens = batches["small"]
    assert prompts * samples == 8 and prompt_tokens + new_tokens == 64
    assert batches["wide"] == (16, 16, 256, check.WIDE_NEW_TOKENS) and check.WIDE_NEW_TOKENS < 512
    assert batches["large"] == (16, 16, 256, 512)


def test_a_sections_time_limit_can_be_given_and_is_checked_by_name():
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    args = check._args(["--section_s", "generation=420"])
    assert args.limits["generation"] == 420 and args.limits["env"] == check.SECTION_S["env"]
    proc = _run("--plan", "--section_s", "generation=soon")
    assert proc.returncode == 2 and "'soon' is not a number" in proc.stderr
