"""RLJob end to end on a real local Ray: trainer, rollout worker and curriculum actor as Ray actors,
real generation, Parquet rollout files and filesystem weight transfer, in both modes."""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.batching import BatchingConfig
from marinrl.config.curriculum import CurriculumConfig, LessonConfig, LessonDependency
from marinrl.config.env import EnvConfig
from marinrl.config.inflight import InflightConfig
from marinrl.config.model import ModelConfig
from marinrl.config.trainer import RLAdamConfig
from marinrl.envs.base import make_env
from marinrl.job.rl_job import ConfigError, RLJob, RLJobConfig
from marinrl.job.run_lock import read_lease
from marinrl.storage.rollouts import RolloutReader, summarize
from marinrl.train.audit import audit, read_trail

pytestmark = pytest.mark.timeout(1200)  # whole jobs: twice the suite's default (pyproject.toml), for a loaded machine

ECHO = LessonConfig(lesson_id="echo", env=EnvConfig("echo", {"alphabet_size": 10, "length": 1}), max_tokens=1,
                    graduate_at=None)


def job_config(tmp_path, **overrides) -> RLJobConfig:
    base = dict(
        run_id="job", run_root=str(tmp_path),
        model=ModelConfig(model=LlamaConfig(seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                            num_kv_heads=2, gradient_checkpointing=False), vocab_size=512),
        curriculum=CurriculumConfig(lessons=(ECHO,)), num_train_steps=5, groups_per_step=4, n_generations=4,
        eval_every=2, eval_examples=8, optimizer=RLAdamConfig(learning_rate=1e-3),
        batching=BatchingConfig(max_length=32, min_bucket=8))
    base.update(overrides)
    return RLJobConfig(**base)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(max_staleness=-1), "max_staleness"),
        (dict(groups_per_step=5, n_rollout_workers=2), "groups_per_step"),
        (dict(num_train_steps=0), "num_train_steps"),
        (dict(curriculum=None), "curriculum"),
        (dict(curriculum=CurriculumConfig(lessons=(dataclasses.replace(ECHO, temperature=0.0),))),
         r"curriculum.lessons\[echo\].temperature"),
        (dict(max_uses=2, max_staleness=0), "max_uses"),
        (dict(max_staleness=0, inflight=InflightConfig(enabled=True)), "inflight.enabled"),
    ],
)
def test_a_bad_config_names_the_field_before_anything_starts(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=rf"RLJobConfig\.{field}"):
        RLJob(job_config(tmp_path, **overrides))


def test_a_lesson_depending_on_an_unknown_lesson_is_refused():
    with pytest.raises(ValueError, match="nope"):
        CurriculumConfig(lessons=(dataclasses.replace(ECHO, dependencies=(LessonDependency("nope"),)),))


def _run(tmp_path, ray_session, **overrides):
    cfg = job_config(tmp_path, **overrides)
    result = RLJob(cfg).run()
    assert ray_session.is_initialized()  # a job on an existing Ray leaves it running
    assert read_lease(cfg.run_dir) is None  # the run's lease is released (marinrl/job/run_lock.py)
    return cfg, result


def test_on_policy_job_with_delta_weight_sync_trains_on_the_exact_weights(tmp_path, ray_session):
    """Exact on-policy training (max_staleness 0): every step on its own weights, by the metric, the rollout
    files and the audit trail. Weights reach the rollout worker as deltas (a snapshot every 3 versions):
    on-policy, each step's importance ratio π_θ/μ is 1 to float32 precision only if the applied deltas
    rebuilt the trainer's weights. 1e-3 is ten times the fp32 bound derived in test_on_policy_ratio for a
    wider model (hidden 64); weights one AdamW step (lr 1e-3) off move log-ratios by far more."""
    from marinrl.config.transfer import FilesystemTransferConfig

    weights = FilesystemTransferConfig(root=f"{tmp_path}/job/weights", delta=True, full_every=3)
    cfg, result = _run(tmp_path, ray_session, max_staleness=0, weights=weights)
    history = result.train["history"]
    assert result.train["final_step"] == 5 and [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert all(h["batch/staleness_max"] == 0 for h in history)  # exact on-policy
    assert result.curriculum_step == 5  # one curriculum iteration per trainer step
    (rollouts,) = result.rollouts
    assert rollouts["weight_step"] == 5 and rollouts["batches_written"] >= 5 and rollouts["sample_failures"] == 0
    assert [e["weight_step"] for e in rollouts["evals"] if e["kind"] == "eval"] == [0, 2, 4, 5]
    summary = summarize(f"{cfg.run_dir}/rollouts")
    assert summary["totals"]["rollouts"] == rollouts["rollouts_written"]
    assert sorted(map(int, summary["steps"])) == [0, 1, 2, 3, 4]  # one weight version per batch, each trained
    # The audit trail (marinrl/train/audit.py) in the run folder: what the trainer took, step by step
    trail = read_trail(f"{cfg.run_dir}/trained")
    (incarnation,) = trail.values()
    assert incarnation.start["first_step"] == 0 and incarnation.start["parent"] is None
    assert [[g for g, _ in incarnation.steps[s]["groups"]] for s in range(1, 6)] == result.train["trained_groups"]
    assert all(w == s - 1 for s in range(1, 6) for _, w in incarnation.steps[s]["groups"])  # on-policy
    counts = audit(trail, num_steps=5, groups_per_step=4, max_staleness=0)
    assert (counts.steps, counts.groups_trained, counts.groups_lost, counts.groups_duplicated) == (5, 20, 0, 0)
    logged = [json.loads(line.split("json_logger: ", 1)[1]) for line in
              (tmp_path / "job" / "logs" / "trainer.log").read_text().splitlines() if "json_logger: {" in line]
    ratios = {e["step"]: (e["metrics"]["train/ratio_min"], e["metrics"]["train/ratio_max"]) for e in logged
              if e.get("event") == "log" and "train/ratio_min" in e["metrics"]}
    assert sorted(ratios) == [0, 1, 2, 3, 4], ratios  # Levanter's step of each of the 5 updates
    assert all(abs(lo - 1) < 1e-3 and abs(hi - 1) < 1e-3 for lo, hi in ratios.values()), ratios
    assert list((tmp_path / "job" / "weights").rglob("delta.bin"))  # the versions after a snapshot were deltas


def test_async_job_overlaps_generation_with_training(tmp_path, ray_session):
    """The worker runs a version ahead: while the trainer applies update s it generates, with weights
    s - 1, the batch update s + 1 trains on (staleness 1). Checked from the rollout files, not only the
    trainer's metric: which weights made each trained group, at every step."""
    cfg, result = _run(tmp_path, ray_session, max_staleness=1)
    history = result.train["history"]
    assert result.train["final_step"] == 5 and result.curriculum_step == 5
    made_with = {g.group_id: b.weight_step
                 for b in RolloutReader(f"{cfg.run_dir}/rollouts").read_new() for g in b.groups}
    staleness = [{h["step"] - 1 - made_with[g] for g in groups}
                 for h, groups in zip(history, result.train["trained_groups"])]
    assert all(s <= {0, 1} for s in staleness), staleness  # the window, from the files
    assert [max(s) for s in staleness] == [h["batch/staleness_max"] for h in history]  # the metric tells the truth
    ahead = [step for step, s in enumerate(staleness, start=1) if 1 in s]
    # The first update's compile alone lets the worker make the second batch from weights 0; overlap on a
    # later step too shows generation kept running beside training, not once by chance.
    assert len(ahead) >= 2, (staleness, history)


def test_replay_job_reuses_rollouts_and_reward_rises(tmp_path, ray_session):
    """The quickstart recipe, shortened, with each rollout trained on up to twice."""
    _, result = _run(tmp_path, ray_session, max_staleness=2, max_uses=2, num_train_steps=30, groups_per_step=32,
                     n_generations=16, eval_every=30, eval_examples=256,
                     model=ModelConfig(model=LlamaConfig(seq_len=32, hidden_dim=64, intermediate_dim=256, num_layers=2,
                                                         num_heads=4, num_kv_heads=4, gradient_checkpointing=False),
                                       vocab_size=512))
    history = result.train["history"]
    assert result.train["final_step"] == 30
    assert max(h["batch/use_mean"] for h in history) > 1  # some groups were trained on a second time
    assert all(h["batch/staleness_max"] <= 2 for h in history)
    # How much the policy learns in 30 steps depends on timing by design: with `max_uses 2`, how much of
    # each batch is a second use of older groups depends on how fast the rollout worker keeps up (at
    # worst half the groups are fresh). So the size of the rise is asserted where its noise is known,
    # and on the greedy eval only its direction:
    # - sampled reward: 3 batches of 32 x 16 samples, at least half of them fresh (`max_uses 2`), so at least
    #   768 draws each; a rate p over n draws has a standard error sqrt(p (1 - p) / n), tiny near 0 where this
    #   run starts. The late mean must exceed the early one by 3 standard errors of their difference, from the
    #   rates observed (a fixed 0.05 was 3 errors at p = 0.5 but 6 at the rates seen: it failed a run that
    #   rose 0.003 -> 0.046 at load ~4). Measured: 0.003 -> 0.08 at load 8, 0.005 -> 0.15 at load 3.5.
    # - eval: one greedy answer to each of 256 prompts drawn from the lesson's 10 (alphabet 10, length 1;
    #   all 10 are drawn except with probability 10 * 0.9^256 < 1e-10), so it scores how many letters the
    #   greedy policy echoes: a policy that learned nothing answers exactly as before (end == start), one
    #   that learned answers more. Measured 0 -> 0.27 at load 3.5, 0 -> 0.05 (64 prompts) at load 5-7.
    evals = [e for e in result.rollouts[0]["evals"] if e["kind"] == "eval"]
    start, end = evals[0]["metrics"]["eval/echo/reward_mean"], evals[-1]["metrics"]["eval/echo/reward_mean"]
    assert start <= 0.2 and end > start, (start, end)
    early = np.mean([h["batch/reward_mean"] for h in history[:3]])
    late = np.mean([h["batch/reward_mean"] for h in history[-3:]])
    n = 3 * 32 * 16 // 2
    assert late > early + 3 * np.sqrt((early * (1 - early) + late * (1 - late)) / n), (early, late)


def test_the_quickstart_is_its_yaml_with_overrides_and_a_held_out_eval():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "experiments" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    quickstart = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = quickstart  # dataclasses look their module up there
    spec.loader.exec_module(quickstart)
    config = quickstart.QuickstartConfig.from_args(["--max_staleness", "0", "--target_eval_reward", "0.9"])
    job = config.job
    job.validate()
    assert job.max_staleness == 0 and config.target_eval_reward == 0.9
    assert job.run_id.startswith("quickstart-")  # a rerun starts fresh instead of resuming the last run
    assert quickstart.QuickstartConfig.from_args(["--run_id", "mine"]).job.run_id == "mine"
    (lesson,) = job.curriculum.lessons
    env = make_env(lesson.env)
    rng = np.random.default_rng(0)
    train = {p.example_id for p in env.problems(500, rng, "train")}
    evals = {p.example_id for p in env.problems(100, rng, "eval")}
    assert evals and not train & evals  # the eval reward is measured on prompts never trained on


def test_a_multi_agent_job_trains_every_agents_turns_under_its_policy(tmp_path, ray_session):
    """solve_check through the whole job: per-(problem, turn, agent) groups reach the files and the
    trainer, each tagged with its agent and policy, and the checker runs under a second policy name
    (declared `shared` in `policies:`: without it the job is refused, tests/test_policies.py)."""
    duo = LessonConfig(lesson_id="duo", env=EnvConfig("solve_check", {"max_operand": 4,
                                                                      "policies": {"checker": "critic"}}),
                       max_tokens=2, graduate_at=None)
    from marinrl.config.policies import PolicyConfig

    shared = {"policy": PolicyConfig(), "critic": PolicyConfig(specialization="shared")}  # both train the one model
    cfg, result = _run(tmp_path, ray_session, curriculum=CurriculumConfig(lessons=(duo,)), num_train_steps=3,
                       eval_every=3, policies=shared)
    assert result.train["final_step"] == 3 and all(np.isfinite(h["loss"]) for h in result.train["history"])
    tags = collections.Counter()
    tag_of, versions = {}, collections.defaultdict(set)
    for batch in RolloutReader(f"{cfg.run_dir}/rollouts").read_new():
        for group in batch.groups:
            names = {(r.agent_name, r.policy_name) for r in group.rollouts}
            assert len(names) == 1  # a group compares one agent's turns with each other
            tag_of[group.group_id] = tag = names.pop()
            tags[tag] += 1
            versions[tag].add(batch.weight_step)
    assert set(tags) == {("solver", "policy"), ("checker", "critic")}
    assert tags[("solver", "policy")] == tags[("checker", "critic")]
    # What the trainer took: groups of both agents, each under its own policy, each once, from the files
    trained = [g for step in result.train["trained_groups"] for g in step]
    assert len(trained) == 3 * cfg.groups_per_step and len(set(trained)) == len(trained)
    assert {tag_of[g] for g in trained} == {("solver", "policy"), ("checker", "critic")}
    assert all(f":{tag_of[g][0]}:" in g for g in trained)  # the agent the environment named the group for
    # Both policies' turns were sampled with weights the trainer published after its first update
    assert all(max(v) >= 1 for v in versions.values()), dict(versions)
    evals = [e for e in result.rollouts[0]["evals"] if e["kind"] == "eval"]
    assert {"eval/duo/solver/success_frac", "eval/duo/checker/success_frac"} <= set(evals[-1]["metrics"])
