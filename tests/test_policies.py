"""`policies:` in the job config: validation and resolution before anything starts, environments whose
agents play undefined policies refused before Ray, and a rollout of a policy the trainer does not
train stopping it at ingestion (real replay buffer, real TrainWorker on a tiny Llama)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_job import job_config
from test_train_worker import make_rollout_batch, worker_config

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.env import EnvConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.model import ModelConfig
from marinrl.config.placement import PlacementConfig
from marinrl.config.policies import PolicyConfig, policy_models, policy_names, resolve_policies
from marinrl.config.replay import OffPolicyConfig, ReplayConfig
from marinrl.config.rollout_worker import ModelStream
from marinrl.config.trainer import RLAdamConfig
from marinrl.config.transfer import FilesystemTransferConfig, RayTransferConfig
from marinrl.job.plan import build_trainer, rollout_worker_config, train_worker_config
from marinrl.job.rl_job import ConfigError, RLJob
from marinrl.storage.rollouts import RolloutWriter
from marinrl.train.replay.buffer import ReplayBuffer, ReplayIngestionError, UnknownPolicyError
from marinrl.train.worker import TrainWorker
from marinrl.types import RolloutBatch, RolloutGroup

DUO = LessonConfig(lesson_id="duo", env=EnvConfig("solve_check", {"max_operand": 4, "policies": {"checker": "critic"}}),
                   max_tokens=2, graduate_at=None)


def _retag(batch: RolloutBatch, policy: str, lesson: str) -> RolloutBatch:
    groups = tuple(RolloutGroup(tuple(dataclasses.replace(r, policy_name=policy, lesson_id=lesson) for r in g.rollouts))
                   for g in batch.groups)
    return dataclasses.replace(batch, groups=groups)


def test_no_policies_is_one_shared_policy_and_changes_nothing(tmp_path):
    job = job_config(tmp_path)
    assert job.policies == {} and policy_names(job) == ("policy",)
    assert resolve_policies(job) is job
    assert train_worker_config(job).policies == ("policy",)
    RLJob(job)  # the echo lesson plays `policy`: accepted


def test_an_environment_playing_an_undefined_policy_is_refused_before_ray(tmp_path):
    with pytest.raises(ConfigError, match=r"RLJobConfig\.curriculum\.lessons\[duo\]\.env\.args: .*policy 'critic', "
                                          r"which the job does not define \(it trains 'policy'\)"):
        RLJob(job_config(tmp_path, curriculum=CurriculumConfig(lessons=(DUO,))))
    shared = {"policy": PolicyConfig(), "critic": PolicyConfig(specialization="shared")}
    job = RLJob(job_config(tmp_path, curriculum=CurriculumConfig(lessons=(DUO,)), policies=shared)).config
    assert train_worker_config(job).policies == ("policy", "critic")


@pytest.mark.parametrize("policies, lora, field", [
    ({"policy": PolicyConfig(specialization="solo")}, None, "policies.policy.specialization"),
    ({"policy": PolicyConfig(), "critic": PolicyConfig(optimizer=RLAdamConfig(learning_rate=0.1))}, None,
     "policies.critic.optimizer"),
    ({"policy": PolicyConfig(specialization="full", lora=LoraRLConfig())}, None, "policies.policy.lora"),
    ({"policy": PolicyConfig(specialization="lora", lora=LoraRLConfig(rank=0))}, None, "policies.policy.lora.rank"),
    ({"policy": PolicyConfig()}, LoraRLConfig(), "lora"),
])
def test_a_bad_policies_block_names_the_field(tmp_path, policies, lora, field):
    with pytest.raises(ConfigError, match=rf"RLJobConfig\.{field}: "):
        RLJob(job_config(tmp_path, policies=policies, lora=lora))


def test_lora_and_full_policies_next_to_others_are_policy_models_of_their_own(tmp_path):
    """L2/L3: the shared policies together are one model, each `lora` or `full` policy another, with
    its own model, optimizer, adapters, trainer paths, weight stream and rollout files."""
    policies = {"policy": PolicyConfig(), "critic": PolicyConfig(),
                "coach": PolicyConfig(specialization="full", optimizer=RLAdamConfig(learning_rate=0.01)),
                "judge": PolicyConfig(specialization="lora", lora=LoraRLConfig(rank=2))}
    job = RLJob(job_config(tmp_path, policies=policies)).config
    models = policy_models(job)
    assert [(m.name, m.policies) for m in models] == [("policy", ("policy", "critic")), ("coach", ("coach",)),
                                                      ("judge", ("judge",))]
    shared, coach, judge = models
    assert shared.lora is None and shared.optimizer == job.optimizer
    assert coach.optimizer.learning_rate == 0.01 and coach.lora is None
    assert judge.lora == LoraRLConfig(rank=2) and judge.model == job.model  # the adapter's base
    for m in models:
        run_dir = f"{job.run_dir}/policies/{m.name}"
        worker = train_worker_config(job, m)
        assert worker.policies == m.policies and worker.rollout_root == f"{run_dir}/rollouts"
        assert worker.weights.root == f"{run_dir}/weights" and worker.lora == m.lora
        assert worker.optimizer.learning_rate == m.optimizer.learning_rate
        assert str(worker.trainer.checkpointer.base_path) == f"{run_dir}/checkpoints"
        assert worker.trainer.id == m.name and worker.trainer.num_train_steps == job.num_train_steps
    streams = rollout_worker_config(job, 0).streams
    assert streams == tuple(ModelStream(m.name, m.policies, f"{job.run_dir}/policies/{m.name}/rollouts",
                                        train_worker_config(job, m).weights, m.lora) for m in models)
    one = RLJob(job_config(tmp_path, policies={"policy": PolicyConfig(), "critic": PolicyConfig()})).config
    (stream,) = rollout_worker_config(one, 0).streams  # L1: one model, every policy
    assert len(policy_models(one)) == 1 and (stream.name, stream.policies) == ("policy", ())
    placed = dict(policies, coach=PolicyConfig(specialization="full", placement=PlacementConfig(num_cpus=3)))
    coach = policy_models(job_config(tmp_path, policies=placed))[1]
    assert coach.placement == PlacementConfig(num_cpus=3) and models[2].placement == job.ray.trainer


def test_a_weight_transfer_is_split_per_policy_model(tmp_path):
    policies = {"policy": PolicyConfig(specialization="full"), "critic": PolicyConfig(specialization="full")}
    files = job_config(tmp_path, policies=policies, weights=FilesystemTransferConfig(root="memory://w", delta=True))
    assert [m.weights for m in policy_models(files)] == [  # fanout: auto, decided for this fleet
        FilesystemTransferConfig(root="memory://w/policy", delta=True, fanout="storage"),
        FilesystemTransferConfig(root="memory://w/critic", delta=True, fanout="storage")]
    ray_ = job_config(tmp_path, policies=policies, weights=RayTransferConfig(name="w"))
    assert [m.weights.name for m in policy_models(ray_)] == ["w-policy", "w-critic"]


@pytest.mark.parametrize("overrides, field", [
    (dict(policies={"policy": PolicyConfig(), "critic": PolicyConfig(
        specialization="full", model=ModelConfig(model=job_config("/tmp").model.model, vocab_size=512,
                                                 tokenizer="/nonexistent/tok"))}), "policies.critic.model.tokenizer"),
    (dict(inflight=dataclasses.replace(job_config("/tmp").inflight, enabled=True)), "inflight.enabled"),
    (dict(policies={"policy": PolicyConfig(specialization="full"), "critic": PolicyConfig(
        specialization="lora", lora=LoraRLConfig(target_modules="qproj"))}), "policies.critic.lora.target_modules"),
    (dict(policies={"policy": PolicyConfig(specialization="full"), "critic": PolicyConfig(
        specialization="full", placement=PlacementConfig(num_hosts=2))}), "policies.critic.placement"),
    (dict(policies={"policy": PolicyConfig(specialization="full"), "critic": PolicyConfig(
        specialization="full", placement=PlacementConfig(num_cpus=-1))}), "policies.critic.placement.num_cpus"),
    (dict(policies={"policy": PolicyConfig(), "critic": PolicyConfig(placement=PlacementConfig())}),
     "policies.critic.placement"),
])
def test_what_several_policy_models_cannot_do_is_refused(tmp_path, overrides, field):
    policies = overrides.pop("policies", {"policy": PolicyConfig(specialization="full"),
                                          "critic": PolicyConfig(specialization="lora")})
    with pytest.raises(ConfigError, match=rf"RLJobConfig\.{field}: "):
        RLJob(job_config(tmp_path, policies=policies, **overrides))


def test_a_single_policy_brings_its_own_optimizer_and_adapters(tmp_path):
    policies = {"policy": PolicyConfig(specialization="lora", lora=LoraRLConfig(rank=4),
                                       optimizer=RLAdamConfig(learning_rate=0.01))}
    job = RLJob(job_config(tmp_path, policies=policies)).config
    assert job.lora == LoraRLConfig(rank=4) and job.optimizer.learning_rate == 0.01
    worker = train_worker_config(job)
    assert worker.lora == LoraRLConfig(rank=4) and worker.optimizer.learning_rate == 0.01
    assert [s.lora for s in rollout_worker_config(job, 0).streams] == [LoraRLConfig(rank=4)]
    assert resolve_policies(job) == job  # resolving twice changes nothing
    plain = RLJob(job_config(tmp_path, policies={"policy": PolicyConfig(specialization="lora")})).config
    assert plain.lora == LoraRLConfig()  # `lora` without its block: the defaults


def test_the_replay_buffer_refuses_a_policy_it_does_not_train():
    buffer = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=1)), policies=("policy",))
    rng = np.random.default_rng(0)
    assert buffer.ingest([make_rollout_batch(0, rng)]) == 2
    with pytest.raises(UnknownPolicyError, match=r"lesson 'duo' .*policy 'critic', which this trainer does not train"):
        buffer.ingest([_retag(make_rollout_batch(0, rng), "critic", "duo")])
    anything = ReplayBuffer(ReplayConfig(sampling=OffPolicyConfig(staleness=1)))  # None: the buffer on its own
    assert anything.ingest([_retag(make_rollout_batch(0, rng), "critic", "duo")]) == 2


def test_a_rollout_of_an_undefined_policy_stops_the_trainer_at_ingestion(tmp_path):
    cfg = worker_config(tmp_path, steps=2, sampling=OffPolicyConfig(staleness=1), run_id="foreign")
    cfg.replay = dataclasses.replace(cfg.replay, timeout_s=60)
    RolloutWriter(cfg.rollout_root).write(_retag(make_rollout_batch(0, np.random.default_rng(0)), "critic", "duo"))
    with pytest.raises(ReplayIngestionError, match=r"lesson 'duo'.*policy 'critic'") as caught:
        TrainWorker(cfg, build_trainer(cfg)).run()
    assert isinstance(caught.value.__cause__, UnknownPolicyError)


@pytest.mark.parametrize("name, models", [("policies", [("policy", ("policy", "critic"))]),
                                          ("policy_models", [("policy", ("policy",)), ("other", ("other",))])])
def test_the_policies_examples_pass_preflight(tmp_path, name, models):
    import pathlib

    from marinrl.config.errors import load_job_config
    from marinrl.config.job import RLJobConfig
    from marinrl.job.preflight import check_job

    path = pathlib.Path(__file__).parents[1] / "experiments" / f"{name}.yaml"
    job = load_job_config(RLJobConfig, str(path), ["--run_root", str(tmp_path)])
    check_job(job)
    assert [(m.name, m.policies) for m in policy_models(job)] == models
