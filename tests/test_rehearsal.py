"""The real-size rehearsal (bench/rehearsal.py): Qwen3-0.6B's recipe end to end on this CPU, killed after
its step-3 checkpoint and resumed to step 4. About 6.5 minutes of a 2-core machine and 22 of its 24 GiB
(docs/performance.md, "Rehearsal"): `make test-slow` runs it, `make test` leaves it out (and nothing else
should run beside it). It runs in its own process, as `python bench/rehearsal.py` does, because the job's
actors inherit the fake-device count from the environment."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _rehearsal(tmp_path, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)  # its own --devices
    out = subprocess.run([sys.executable, str(REPO / "bench" / "rehearsal.py"), "--root", str(tmp_path), *args],
                         capture_output=True, text=True, env=env, timeout=3600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_rehearsal_of_the_0p6b_recipe(tmp_path):
    r = _rehearsal(tmp_path)
    assert 5.5e8 < r["params"] < 6.5e8  # Qwen3-0.6B with tied embeddings: 596M
    assert r["steps_trained"] == 4 and r["killed_at_step"] == 3
    assert r["resumed"] and r["resumed_from"].endswith("step-2"), r["resumed_from"]  # Levanter's step-2 holds step 3
    assert r["rollout_dtype"] == "bfloat16", r["rollout_dtype"]
    # One bf16 version: 2 bytes a parameter plus the packed header and alignment (a few KB).
    assert 0.49 < r["weight_bytes_per_version"] / r["f32_weight_bytes"] < 0.51, r["weight_bytes_per_version"]
    # tensorstore compresses the checkpoint (AdamW's moments after 3 steps of lr ~1e-7 shrink a lot), but
    # the f32 master weights, read from bf16, hold 16 significant bits each: at least 2 bytes a parameter.
    assert r["checkpoint_bytes"] >= 0.5 * r["f32_weight_bytes"], r["checkpoint_bytes"]
    assert r["hf_reads_per_process"] == 1, (r["hf_reads"], r["not_available"])
    assert r["jit_constant_bytes"] is not None, r["not_available"]
    assert r["jit_constant_bytes"] <= 0.01 * r["f32_weight_bytes"], r["jit_constant_bytes"]
    for role in ("trainer", "rollout"):
        predicted, measured = r["predicted_peak_gib"][role], r["measured_peak_gib"][role]
        assert predicted is not None and measured is not None, (role, r["not_available"])
        assert 0.7 * predicted <= measured <= 1.3 * predicted, (role, predicted, measured)
    # the mismatch phase: both heads measured on the same checkpoint (bench/rehearsal_mismatch.py)
    for head in ("bf16_head", "f32_head"):
        m = r["mismatch"][head]
        assert m["tokens"] > 0 and 0 <= m["k3_kl"] and 0 <= m["abs_logprob_mean"] <= m["abs_logprob_max"], (head, m)
