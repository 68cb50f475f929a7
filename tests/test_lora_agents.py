"""Many agents, one base, end to end (docs/policies.md, "Many agents, one base"): four `lora` policies of one
base are one trainer holding one copy of the base and four adapters, and every rollout worker samples all four
over one copy of the base; each adapter learns its own agent's role. Real local Ray, a tiny Llama."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from test_job import job_config
from test_train_worker import checkpoint_arrays

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.policies import PolicyConfig, trainers
from marinrl.config.trainer import RLAdamConfig
from marinrl.job.rl_job import RLJob
from marinrl.models.policy_model import build_model
from marinrl.storage.rollouts import RolloutReader
from marinrl.transfer.base import ModelSkeleton

pytestmark = pytest.mark.timeout(1200)  # a whole job: twice the suite's default (pyproject.toml), for a loaded machine

TARGETS = {"first": "0", "second": "@", "third": "P", "fourth": "z"}
AGENTS = LessonConfig(lesson_id="roles", env=EnvConfig("roles", {"targets": TARGETS,
                                                                  "policies": {a: a for a in TARGETS}}),
                      max_tokens=1, graduate_at=None)
LR = RLAdamConfig(learning_rate=3e-2)


def _policies(**own) -> dict[str, PolicyConfig]:
    return {a: PolicyConfig(**{"specialization": "lora", "lora": LoraRLConfig(rank=4, alpha=8.0, seed=k),
                               "optimizer": LR, **own.get(a, {})})
            for k, a in enumerate(TARGETS)}


def _job(tmp_path, steps: int, **own):
    return job_config(tmp_path, curriculum=CurriculumConfig(lessons=(AGENTS,)), num_train_steps=steps,
                      eval_every=steps, groups_per_step=4, n_generations=8, policies=_policies(**own),
                      optimizer=LR)


def test_lora_policies_of_one_base_share_one_trainer_unless_one_asks_for_its_own(tmp_path):
    from marinrl.config.placement import PlacementConfig

    (shared,) = trainers(_job(tmp_path, 1))
    assert shared.name == "first+second+third+fourth" and [m.name for m in shared.models] == list(TARGETS)
    assert shared.run_dir.endswith("/trainers/first+second+third+fourth")
    alone = trainers(_job(tmp_path, 1, third={"placement": PlacementConfig(num_cpus=1)}))
    assert [t.name for t in alone] == ["first+second+fourth", "third"]
    other_lr = trainers(_job(tmp_path, 1, second={"optimizer": RLAdamConfig(learning_rate=1e-3)}))
    assert [t.name for t in other_lr] == ["first+third+fourth", "second"]  # one optimizer per trainer


def test_four_agents_learn_their_own_roles_as_four_adapters_on_one_base(tmp_path, ray_session):
    """One trainer (one copy of the base, four adapters) and the rollout workers' one base: each adapter trains
    only its agent's groups, each stream carries its adapter alone, and each agent's reward rises."""
    steps = 30
    cfg = _job(tmp_path, steps)
    result = RLJob(cfg).run()
    assert set(result.policies) == set(TARGETS)
    assert all(r == result.train for r in result.policies.values())  # one trainer trained them all
    train = result.train
    assert train["final_step"] == steps
    trained = [g for step in train["trained_groups"] for g in step]
    assert len(trained) == len(set(trained)) == steps * 4 * len(TARGETS)  # each adapter's 4 groups a step
    for k, agent in enumerate(TARGETS):
        written = [r for b in RolloutReader(f"{cfg.run_dir}/policies/{agent}/rollouts").read_new() for r in b.rollouts]
        assert {r.policy_name for r in written} == {agent} and {r.agent_name for r in written} == {agent}
        assert sum(f":t{k}:{agent}:" in g for g in trained) == steps * 4  # its own groups, every step

    # each stream carries its adapter alone: a fraction of the model's bytes
    full = ModelSkeleton(build_model(cfg.model)).nbytes
    for agent in TARGETS:
        pointer = json.loads((pathlib.Path(cfg.run_dir) / "policies" / agent / "weights" / "latest.json").read_text())
        assert pointer["weight_step"] == steps and pointer["bytes"] < full / 4, (agent, pointer, full)
    (rollouts,) = result.rollouts
    evals = [e["metrics"] for e in rollouts["evals"] if e["kind"] == "eval"]
    assert {f"eval/roles/policy/{a}/reward_mean" for a in TARGETS} <= set(evals[-1])  # evaluated per policy
    # the one trainer's checkpoint: the four adapters stacked, no base (it is rebuilt from `model` on resume)
    assert train["checkpoint"].startswith(f"{cfg.run_dir}/trainers/first+second+third+fourth/checkpoints/")
    saved = {k: v for k, v in checkpoint_arrays(train["checkpoint"]).items() if k.startswith("model/")}
    assert saved and all("lora" in k and v.shape[0] == len(TARGETS) for k, v in saved.items()), \
        {k: v.shape for k, v in saved.items()}
    # Each step trains 4 groups of 8 samples per agent; a sample's reward is in [0, 1], so the mean of 3 steps
    # (96 samples) has a standard error of at most sqrt(0.25 / 96) = 0.051, a difference of two 0.072: a rise
    # of 0.2 (about 3 of those) does not come from noise.
    for agent in TARGETS:
        rewards = [h[f"policy_model/{agent}/batch/reward_mean"] for h in train["history"]]
        early, late = np.mean(rewards[:3]), np.mean(rewards[-3:])
        print(f"{agent}: reward {early:.3f} over the first 3 steps, {late:.3f} over the last 3")
        assert late > early + 0.2, (agent, rewards)


def test_the_dry_run_counts_one_base_and_k_adapters_with_their_optimizer_states():
    """The recipe's trainer (four adapters on one base) against the same job with one of its policies: the
    parameters grow by three adapters, the gradients and AdamW's moments are four adapters' (each slot's
    moments and step count: `adapter_slots.per_slot`), and each step's activations are four batches'."""
    import dataclasses

    from marinrl.config.errors import load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.config.policies import resolve_policies
    from marinrl.dry_run.memory import predicted_memory

    job = load_job_config(RLJobConfig, str(pathlib.Path(__file__).parents[1] / "experiments" / "lora_agents.yaml"), [])
    four = predicted_memory(job, "trainer", 1).bytes_per_device
    one = predicted_memory(resolve_policies(dataclasses.replace(job, policies={"first": job.policies["first"]})),
                           "trainer", 1).bytes_per_device
    adapter = one["gradients"]  # the trainable arrays of one adapter
    assert 0 < adapter < one["parameters"] / 4  # rank 4 on a 64-wide model: a fraction of the base
    assert four["parameters"] - one["parameters"] == 3 * adapter
    assert four["gradients"] == 4 * adapter
    assert 4 * one["optimizer_state"] - 64 <= four["optimizer_state"] <= 4 * one["optimizer_state"]  # + step counts
    assert four["activations"] == 4 * one["activations"]


def test_a_policy_of_a_shared_trainer_exports_its_own_slot(tmp_path):
    """`export_peft` of policy k reads slot k of the shared trainer's checkpoint: the exported arrays are that
    slot's (their sum of |values| to float32 rounding), not another slot's."""
    import equinox as eqx
    import haliax as hax
    import jax
    import safetensors.numpy
    from levanter.checkpoint import save_checkpoint
    from test_train_worker import TINY

    from marinrl.config.model import ModelConfig
    from marinrl.models.adapter_stack import slot_adapters, stacked_adapters
    from marinrl.models.lora import adapter_only
    from marinrl.models.peft_export import export_peft
    from marinrl.models.policy_model import build_model

    configs = [LoraRLConfig(rank=4, alpha=8.0, seed=k) for k in range(3)]
    model = stacked_adapters(build_model(TINY), configs)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    adapters = jax.tree.map(lambda x: x + hax.random.normal(next(keys), x.axes) if isinstance(x, hax.NamedArray)
                            else x, adapter_only(model), is_leaf=lambda x: isinstance(x, hax.NamedArray))
    step_dir = str(tmp_path / "step-3")
    save_checkpoint({"model": adapters}, 3, step_dir)

    def total(tree) -> float:
        return float(sum(np.abs(np.asarray(x, np.float64)).sum()
                         for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))))

    assert isinstance(TINY, ModelConfig)
    export_peft(step_dir, TINY, configs[2], str(tmp_path / "third"), slot=(2, 3))
    exported = safetensors.numpy.load_file(str(tmp_path / "third" / "adapter_model.safetensors"))
    got = sum(np.abs(v.astype(np.float64)).sum() for v in exported.values())
    want, other = total(slot_adapters(adapters, 2)), total(slot_adapters(adapters, 0))
    assert abs(got - want) <= 1e-6 * want and abs(got - other) > 1e-3 * want, (got, want, other)
