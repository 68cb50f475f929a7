"""RLJob with in-flight weight updates, end to end: rollouts whose tokens come from two weight versions
are written, read and trained on. Its own process and local Ray with tests/ on PYTHONPATH, as
tests/test_job_faults.py: Ray's workers import the test environment by its dotted path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import json, pathlib
    from marinrl.curriculum_config import CurriculumConfig, LessonConfig
    from marinrl.envs.base import EnvConfig
    from marinrl.inference.inflight import InflightConfig
    from marinrl.job import RLJob
    from marinrl.storage import RolloutReader
    from test_job import job_config

    root = pathlib.Path({root!r})
    lesson = LessonConfig(lesson_id="waits", env=EnvConfig("inflight_envs:WaitsForNewWeights",
                                                           {{"weights_root": str(root / "job" / "weights")}}),
                          max_tokens=4, graduate_at=None)
    cfg = job_config(root, max_staleness=1, warm_up_sampler=False, curriculum=CurriculumConfig(lessons=(lesson,)),
                     inflight=InflightConfig(enabled=True, swap_every_tokens=2, kv={kv!r}))
    result = RLJob(cfg).run()
    written = [r for batch in RolloutReader(f"{{cfg.run_dir}}/rollouts").read_new() for r in batch.rollouts]
    (rollouts,) = result.rollouts
    print("RESULT " + json.dumps(dict(
        final_step=result.train["final_step"], history=result.train["history"],
        inflight_swaps=rollouts["inflight_swaps"], sample_failures=rollouts["sample_failures"],
        rollouts=[dict(start=r.metadata.weight_step, steps=r.token_weight_steps.tolist(),
                       mask=r.loss_mask.tolist()) for r in written])))
""")


def test_an_async_job_with_in_flight_updates_trains_on_rollouts_of_mixed_versions(tmp_path):
    """Episodes of two turns whose environment waits, between the turns, for the trainer's next weights
    (tests/inflight_envs.py): the second turn is sampled by newer weights, swapped in while the batch is
    being generated. Every step trains, within the staleness window of each group's oldest token."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=str(tmp_path), kv="recompute")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=os.path.dirname(tests))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    history = out["history"]
    assert out["final_step"] == 5 and [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert all(h["batch/staleness_max"] <= 1 for h in history)  # by the oldest token (the default)
    assert out["inflight_swaps"] >= 3 and out["sample_failures"] == 0
    mixed = [r for r in out["rollouts"] if len(set(r["steps"])) > 1]
    assert len(mixed) >= len(out["rollouts"]) // 2, out["rollouts"]  # every batch but the first spans a swap
    for r in mixed:  # turn 1 and the observation: the weights it began with; turn 2: newer ones
        first_obs = r["mask"].index(False)
        assert set(r["steps"][:first_obs + 1]) == {r["start"]} and r["steps"][-1] > r["start"]
    assert any(h["batch/version_spread_max"] >= 1 for h in history)
    assert all(h["batch/token_staleness_mean"] <= 1 for h in history)
