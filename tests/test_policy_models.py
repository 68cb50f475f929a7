"""One policy per agent (docs/policies.md): a job of two policy models, a `full` one (L3) and a `lora`
one (L2), each with its own trainer, weight stream and rollout files, on the `roles` environment
whose agents see the same prompt and must answer differently (one shared model cannot do both).
Real local Ray, real trainers, tiny Llamas. Also the pure routing of a batch to the models."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_job import job_config
from test_train_worker import make_rollout_batch

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.policies import PolicyConfig
from marinrl.config.trainer import RLAdamConfig
from marinrl.job.rl_job import RLJob
from marinrl.rollout.policy_router import split_by_model
from marinrl.types import RolloutBatch, RolloutGroup, RolloutMetadata

pytestmark = pytest.mark.timeout(1200)  # whole jobs: twice the suite's default (pyproject.toml), for a loaded machine

ROLES = LessonConfig(lesson_id="roles", env=EnvConfig("roles", {"policies": {"second": "other"}}),
                     max_tokens=1, graduate_at=None)


def _tagged(batch: RolloutBatch, policies: list[str]) -> RolloutBatch:
    groups = tuple(RolloutGroup(tuple(dataclasses.replace(r, policy_name=p) for r in g.rollouts))
                   for g, p in zip(batch.groups, policies))
    return dataclasses.replace(batch, groups=groups)


def test_a_batch_is_split_per_policy_model_and_stamped_with_its_weights():
    batch = RolloutBatch(make_rollout_batch(3, np.random.default_rng(0)).groups
                         + make_rollout_batch(3, np.random.default_rng(1)).groups, RolloutMetadata("producer", 3))
    batch = _tagged(batch, ["policy", "other", "stranger", "other"][:len(batch.groups)])
    parts = split_by_model(batch, {"policy": "a", "other": "b"}, {"a": 3, "b": 5, "c": 4})
    assert [name for name, _ in parts] == ["a", "b"]  # c has no group: no file
    (_, a), (_, b) = parts
    # a policy no model plays goes to the first model, whose trainer refuses it by name
    assert [g.rollouts[0].policy_name for g in a.groups] == ["policy", "stranger"]
    assert {g.rollouts[0].policy_name for g in b.groups} == {"other"}
    assert a.weight_step == 3 and b.weight_step == 5
    assert all(r.metadata == RolloutMetadata(batch.metadata.worker_id, 5, batch.metadata.created_at)
               for r in b.rollouts)
    assert {g.group_id for _, p in parts for g in p.groups} == {g.group_id for g in batch.groups}


def test_roles_pays_each_agent_for_its_own_character():
    from marinrl.envs.base import Problem
    from marinrl.envs.multiagent import Move, RolesEnv

    env = RolesEnv(policies={"second": "other"})
    first, second = env.agents
    assert (first.policy, second.policy) == ("policy", "other")
    problem = Problem(prompt="3?", answer="", example_id="3")
    assert env.view(problem, first, []) == env.view(problem, second, [Move("first", (48,), "0")])  # same prompt
    pays = {text: env.judge(problem, second, [Move("first", (48,), "0"), Move("second", (), text)])
            for text in ("z", "y", "zz", "0", "", "<|reserved_7|>")}
    assert pays["z"].reward == 1.0 and pays["z"].indicators["success"] == 1.0 and pays["z"].done
    assert pays["y"].reward == 1.0 - 1 / 64 and pays["y"].indicators["success"] == 0.0
    assert pays["zz"].reward == 1.0 and pays["zz"].indicators["success"] == 0.0  # graded on the first byte
    assert pays["0"].reward == 0.0 and pays[""].reward == 0.0  # 74 bytes away, and nothing
    assert pays["<|reserved_7|>"].reward == 0.0  # a special token is no character
    ok = env.judge(problem, first, [Move("first", (48,), "0")])
    assert ok.reward == 1.0 and not ok.done
    with pytest.raises(ValueError, match="targets.first must be one ASCII character"):
        RolesEnv(targets={"first": "ab"})
    with pytest.raises(ValueError, match="policies names unknown agents"):
        RolesEnv(policies={"third": "x"})
    four = RolesEnv(targets={"a": "0", "b": "@", "c": "P", "d": "z"}, policies={"c": "cee"})
    assert [(x.name, x.policy) for x in four.agents] == [("a", "policy"), ("b", "policy"), ("c", "cee"),
                                                         ("d", "policy")]
    assert not four.judge(problem, four.agents[2], [Move("c", (80,), "P")]).done  # the episode ends with `d`
    assert four.judge(problem, four.agents[3], [Move("d", (122,), "z")]).reward == 1.0


POLICIES = {"policy": PolicyConfig(specialization="full"),
            "other": PolicyConfig(specialization="lora", lora=LoraRLConfig(rank=2, alpha=4.0),
                                  optimizer=RLAdamConfig(learning_rate=3e-2))}


def _two_model_job(tmp_path, steps: int, groups: int):
    """`first` is played by `policy` (full: a model of its own), `second` by `other` (a LoRA adapter on its
    own copy of the base), `steps` steps of `groups` groups of 8."""
    cfg = job_config(tmp_path, curriculum=CurriculumConfig(lessons=(ROLES,)), num_train_steps=steps,
                     eval_every=steps, groups_per_step=groups, n_generations=8, policies=POLICIES,
                     optimizer=RLAdamConfig(learning_rate=1e-2))
    return cfg, RLJob(cfg).run()


@pytest.mark.slow  # about 3 minutes on 2 cores: `make test-slow` (the path, a `full` policy beside `lora` ones, in
# `make test`: tests/test_job_faults.py's killed-trainer job and tests/test_lora_agents.py's four-agent job)
def test_two_agents_with_a_model_each_both_learn_their_own_role(tmp_path, ray_session):
    """20 steps of 8 groups: both roles learn, each from its own model's updates."""
    _, result = _two_model_job(tmp_path, steps=20, groups=8)
    # Each step trains 8 groups of 8 samples of its agent; a sample's reward is in [0, 1], so the mean of 3
    # steps (192 samples) has a standard error of at most sqrt(0.25 / 192) = 0.036, and their difference
    # 0.051: a rise of 0.15 (about 3 of those) does not come from noise.
    for name, train in result.policies.items():
        assert train["final_step"] == 20
        rewards = [h["batch/reward_mean"] for h in train["history"]]
        early, late = np.mean(rewards[:3]), np.mean(rewards[-3:])
        assert late > early + 0.15, (name, rewards)


