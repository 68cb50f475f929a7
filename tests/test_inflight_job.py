"""RLJob with in-flight weight updates, end to end: rollouts whose tokens come from two weight versions
are written, read and trained on; with delta weight sync the quickstart learns its task to its eval
bar; a job SIGKILLed mid-run resumes training every group exactly once. Each runs in its own process
and local Ray with tests/ on PYTHONPATH, as tests/test_job_faults.py: Ray's workers import the test
environments (tests/inflight_envs.py) by their dotted path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(1200)  # whole jobs: twice the suite's default (pyproject.toml), for a loaded machine

_SCRIPT = textwrap.dedent("""
    import json, pathlib
    from marinrl.config.curriculum import CurriculumConfig, LessonConfig
    from marinrl.config.env import EnvConfig
    from marinrl.config.inflight import InflightConfig
    from marinrl.job.rl_job import RLJob
    from marinrl.storage.rollouts import RolloutReader
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


def _run_script(script: str) -> dict:
    """Runs `script` in its own process with tests/ on PYTHONPATH; the JSON of its RESULT line."""
    tests = os.path.dirname(os.path.abspath(__file__))
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",  # absolute: Ray's workers start elsewhere
           "PYTHONPATH": os.pathsep.join([tests, *inherited])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(tests))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_an_async_job_with_in_flight_updates_trains_on_rollouts_of_mixed_versions(tmp_path):
    """Episodes of two turns whose environment waits, between the turns, for the trainer's next weights
    (tests/inflight_envs.py): the second turn is sampled by newer weights, swapped in while the batch is
    being generated. Every step trains, within the staleness window of each group's oldest token."""
    out = _run_script(_SCRIPT.format(root=str(tmp_path), kv="recompute"))
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


_LEARNS_SCRIPT = textwrap.dedent("""
    import dataclasses, json, pathlib
    import draccus
    from marinrl.config.curriculum import CurriculumConfig
    from marinrl.config.env import EnvConfig
    from marinrl.config.inflight import InflightConfig
    from marinrl.job.rl_job import RLJob, RLJobConfig
    from marinrl.storage.rollouts import RolloutReader
    from marinrl.config.transfer import FilesystemTransferConfig

    root = pathlib.Path({root!r})
    cfg = draccus.parse(RLJobConfig, config_path="experiments/quickstart.yaml", args=[])
    (echo,) = cfg.curriculum.lessons
    weights = str(root / "job" / "weights")
    lesson = dataclasses.replace(echo, env=EnvConfig("inflight_envs:EchoAcrossASwap",
                                                     {{"weights_root": weights, "echo_args": echo.env.args}}))
    cfg = dataclasses.replace(cfg, run_id="job", run_root=str(root), num_train_steps={steps},
                              curriculum=CurriculumConfig(lessons=(lesson,)), warm_up_sampler=False,
                              inflight=InflightConfig(enabled={enabled}),
                              weights=FilesystemTransferConfig(root=weights, delta=True))
    result = RLJob(cfg).run()
    written = [r for batch in RolloutReader(f"{{cfg.run_dir}}/rollouts").read_new() for r in batch.rollouts]
    (rollouts,) = result.rollouts
    print("RESULT " + json.dumps(dict(
        final_step=result.train["final_step"], weights=rollouts["weights"], inflight_swaps=rollouts["inflight_swaps"],
        evals=[(e["weight_step"], e["metrics"]["eval/echo/reward_mean"]) for e in rollouts["evals"]
               if e["kind"] == "eval"],
        rollouts=len(written), spans=sum(len(set(r.token_weight_steps.tolist())) > 1 for r in written),
        deltas_on_disk=len(list((root / "job" / "weights").rglob("delta.bin"))))))
""")
LEARNING_STEPS = 150
EVAL_BAR = 0.8
"""The quickstart's held-out bar (experiments/quickstart.py)."""


@pytest.mark.slow  # about 2 minutes: `make test-slow` (the CI budget runs the rest; README)
def test_a_job_with_in_flight_swaps_and_delta_sync_learns_the_quickstart_task(tmp_path):
    """The quickstart (its yaml: model, 32 x 16 samples, lr, KL, eval) with in-flight weight updates and
    delta weight sync, on the quickstart's echo task followed by one more, ungraded token that waits for
    the trainer's next weights (tests/inflight_envs.py): every batch after the first is sampled by two
    versions. The greedy eval reward on held-out prompts reaches the quickstart's bar."""
    out = _run_script(_LEARNS_SCRIPT.format(root=str(tmp_path), steps=LEARNING_STEPS, enabled=True))
    assert out["final_step"] == LEARNING_STEPS
    # Tokens of two weight versions in one rollout: every batch but the first (evals are not written).
    assert out["inflight_swaps"] >= LEARNING_STEPS - 1 and out["spans"] >= out["rollouts"] * 0.9, out
    # The rollout worker advanced by deltas, checked against the publisher's checksums, not by snapshots
    # alone: a snapshot every 10 versions (full_every's default), deltas in between.
    weights = out["weights"]
    assert weights["delta_fallbacks"] == 0 and weights["failures"] == 0
    assert weights["deltas_applied"] >= LEARNING_STEPS * 0.8 and out["deltas_on_disk"] >= 1, weights
    # The quickstart's bar, reached; and held near it at the end (64 prompts: SE <= 0.0625).
    evals = out["evals"]
    assert evals[0] == [0, 0.0] and evals[-1][0] == LEARNING_STEPS
    assert max(reward for _, reward in evals) >= EVAL_BAR and evals[-1][1] >= EVAL_BAR - 0.1, evals


_RESUME_SCRIPT = textwrap.dedent("""
    import json, os, pathlib, signal
    import ray
    from marinrl.config.curriculum import CurriculumConfig, LessonConfig
    from marinrl.config.env import EnvConfig
    from marinrl.config.inflight import InflightConfig
    from marinrl.job.rl_job import RLJob
    from marinrl.storage.rollouts import RolloutReader
    from marinrl.config.transfer import FilesystemTransferConfig
    from test_job import job_config
    from test_job_faults import _Saboteur, _actors_of, _committed_checkpoint_step, _poll

    root = pathlib.Path({root!r})
    weights = root / "job" / "weights"
    lesson = LessonConfig(lesson_id="waits", env=EnvConfig("inflight_envs:WaitsForNewWeights",
                                                           {{"weights_root": str(weights)}}),
                          max_tokens=4, graduate_at=None)
    # max_staleness 2: groups trained before the checkpoint are still inside the window after it, so
    # only the restored reader cursor and buffer keep them from being trained again
    cfg = job_config(root, num_train_steps=6, checkpoint_every=2, max_staleness=2, warm_up_sampler=False,
                     eval_every=100, curriculum=CurriculumConfig(lessons=(lesson,)),
                     inflight=InflightConfig(enabled=True, swap_every_tokens=2),
                     weights=FilesystemTransferConfig(root=str(weights), delta=True, full_every=3))
    ckpt_root = f"{{cfg.run_dir}}/checkpoints"
    job = RLJob(cfg)

    def sigkill_trainer_after_first_checkpoint():
        ckpt = _poll(lambda: _committed_checkpoint_step(ckpt_root), "the trainer's first checkpoint")
        (trainer,) = _actors_of(job, "TrainerActor")
        trained = _poll(lambda: (t := ray.get(trainer.trained_groups.remote(), timeout=10)) and t[-1][0] >= ckpt
                        and t, f"the trainer to report step {{ckpt}}")
        os.kill(ray.get(trainer.__ray_call__.remote(lambda self: os.getpid()), timeout=10), signal.SIGKILL)
        return trained

    saboteur = _Saboteur(sigkill_trainer_after_first_checkpoint)
    try:
        saboteur.beside(job.run)
        died = None
    except RuntimeError as e:
        died = str(e)
    before = saboteur.result()
    result = RLJob(cfg).run()
    reader = RolloutReader(f"{{cfg.run_dir}}/rollouts")
    written = [r for batch in reader.read_new() for r in batch.rollouts]
    print("RESULT " + json.dumps(dict(
        died=died, before=before, first_step=result.train["first_step"], final_step=result.train["final_step"],
        after=result.train["trained_groups"], quarantined=reader.quarantined,
        leftovers=[str(p) for p in pathlib.Path(cfg.run_dir, "rollouts").rglob("*") if p.is_file()
                   and (p.name.startswith(".") or p.suffix != ".parquet")],  # a writer's .tmp-* names
        rollouts=[dict(group=r.group_id, steps=r.token_weight_steps.tolist(), mask=r.loss_mask.tolist())
                  for r in written])))
""")


def test_a_job_with_in_flight_updates_sigkilled_mid_run_resumes_training_every_group_exactly_once(tmp_path):
    """The trainer of a job whose rollouts span swaps (as above, with delta sync) is SIGKILLed after its
    first checkpoint; the job ends naming the checkpoint, and the same config resumes from it. Across
    the lineage every trained group is trained once, groups that spanned a swap included, and the
    rollout files hold only whole episodes (the batch cut by the shutdown was never written)."""
    out = _run_script(_RESUME_SCRIPT.format(root=str(tmp_path)))
    assert out["died"] and "the trainer died" in out["died"] and "checkpoints" in out["died"], out["died"]
    before = {step: groups for step, groups in out["before"]}
    first = out["first_step"]
    assert first > 0 and first % 2 == 0 and first == max(s for s in before if s % 2 == 0)  # the latest checkpoint
    assert out["final_step"] == 6
    lineage = [before[s] for s in range(1, first + 1)] + out["after"]
    assert len(lineage) == 6 and all(len(groups) == 4 for groups in lineage)
    trained = [g for groups in lineage for g in groups]
    assert len(trained) == len(set(trained)), "a rollout group was trained twice across the resume"
    assert out["quarantined"] == [] and out["leftovers"] == []  # every file whole and readable, no temp file
    for r in out["rollouts"]:  # whole episodes only: turn, observation, turn
        assert r["mask"].count(False) >= 1 and r["mask"][-1] is True, r
    spans = {r["group"] for r in out["rollouts"] if len(set(r["steps"])) > 1}
    assert len(set(trained) & spans) >= 3, (sorted(spans), trained)  # trained groups that spanned a swap
