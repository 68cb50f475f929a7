"""The quickstart with bfloat16 rollouts over float32 master weights, end to end: the trainer publishes
bf16 versions (half the f32 bytes), the rollout worker samples in bf16, the loss corrects the
sampler/trainer mismatch with TIS (recomputed anchor) and logs it, and the task is learned to the
quickstart's held-out bar. Runs in its own process and local Ray, as tests/test_inflight_job.py."""

from __future__ import annotations

import textwrap

import pytest
from test_inflight_job import EVAL_BAR, _run_script

_SCRIPT = textwrap.dedent("""
    import dataclasses, json, pathlib
    import draccus
    from marinrl.job.rl_job import RLJob, RLJobConfig
    from marinrl.models.policy_model import build_model, model_summary
    from marinrl.report.page import load_run

    root = pathlib.Path({root!r})
    cfg = draccus.parse(RLJobConfig, config_path="experiments/quickstart.yaml",
                        args=["--inference.dtype", "bfloat16", "--loss.ratio_anchor", "recomputed",
                              "--loss.correction", "tis"])
    cfg = dataclasses.replace(cfg, run_id="job", run_root=str(root), num_train_steps={steps})
    result = RLJob(cfg).run()
    (rollouts,) = result.rollouts
    trainer = load_run(cfg.run_dir).trainer
    mismatch = {{k[len("train/mismatch/"):]: list(v.values()) for k, v in trainer.items()
                if k.startswith("train/mismatch/")}}
    print("RESULT " + json.dumps(dict(
        final_step=result.train["final_step"], rollout_dtype=cfg.rollout_dtype(), weights=rollouts["weights"],
        n_params=model_summary(build_model(cfg.model))["n_params"],
        published_bytes=trainer.get("weights/bytes", {{}}), mismatch=mismatch,
        evals=[(e["weight_step"], e["metrics"]["eval/echo/reward_mean"]) for e in rollouts["evals"]
               if e["kind"] == "eval"])))
""")
STEPS = 200
"""The quickstart's own length (experiments/quickstart.yaml)."""


@pytest.mark.slow  # a few minutes: `make test-slow`
def test_the_quickstart_learns_with_bf16_rollouts_and_tis(tmp_path):
    out = _run_script(_SCRIPT.format(root=str(tmp_path), steps=STEPS))
    assert out["final_step"] == STEPS and out["rollout_dtype"] == "bfloat16"
    # Every version the worker received is bf16: half the f32 bytes, plus the packed header (< 1%).
    weights = out["weights"]
    assert weights["failures"] == 0 and weights["versions_received"] >= 1
    f32_bytes = 4 * out["n_params"]
    assert f32_bytes / 2 <= weights["bytes"] < f32_bytes * 0.51, weights
    assert all(f32_bytes / 2 <= b < f32_bytes * 0.51 for b in out["published_bytes"].values())
    # The mismatch is measured at every step and is not zero: bf16 sampling against the trainer's f32 weights.
    mismatch = out["mismatch"]
    assert len(mismatch["abs_logprob_mean"]) == STEPS, sorted(mismatch)
    assert sum(mismatch["abs_logprob_mean"]) / STEPS > 1e-4
    assert all(0.0 <= f <= 1.0 for f in mismatch["tis_clipped_frac"])
    evals = out["evals"]
    assert evals[-1][0] == STEPS
    assert max(reward for _, reward in evals) >= EVAL_BAR and evals[-1][1] >= EVAL_BAR - 0.1, evals
