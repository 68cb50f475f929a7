"""The RolloutManager on its own (no worker, no weight transfer, no storage), on a tiny real model
served by the real InferenceServer. The environments here are test environments: a minimal correct
one and deliberately broken ones."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.rollout.manager import LessonRuntime, RolloutManager
from marinrl.types import Rollout, RolloutGroup, RolloutMetadata

VOCAB = 512
TINY = ModelConfig(model=LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                     num_kv_heads=2, gradient_checkpointing=False), vocab_size=VOCAB, seed=0)


class StartsWithA:
    """Reward 1 when the response starts with the byte 'a' (a real env would grade its task here)."""

    def sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        prompts = [ctx.tokenizer.encode(f"say a {i}") for i in range(n_examples)]
        outs = ctx.generate(prompts, n_generations, sampling, seed=int(rng.integers(2**31)))
        groups = []
        for prompt, gens in zip(prompts, outs):
            gid = uuid.uuid4().hex
            rollouts = []
            for g in gens:
                reward = float(g.tokens[0] == ord("a"))
                rollouts.append(Rollout(
                    prompt_tokens=prompt, response_tokens=g.tokens, response_logprobs=g.logprobs,
                    temperature=sampling.temperature, loss_mask=np.ones(g.tokens.size, bool),
                    token_rewards=np.r_[np.zeros(g.tokens.size - 1), reward], episode_reward=reward,
                    finish_reason=g.finish_reason, env_name="starts_with_a", lesson_id="placeholder",
                    group_id=gid, metadata=RolloutMetadata("env", 0)))
            groups.append(RolloutGroup(tuple(rollouts)))
        return groups, {"prompts": float(n_examples)}


class Raises:
    def sample(self, *args):
        raise RuntimeError("grader crashed")


class HalfMalformed(StartsWithA):
    def sample(self, *args):
        groups, metrics = super().sample(*args)
        return [groups[0], "not a group", groups[0]] + groups[1:], metrics  # junk and a duplicate


class RecordingCurriculum:
    def __init__(self):
        self.training, self.evals = [], []

    def update_from_training(self, lesson_id, rewards, step):
        self.training.append((lesson_id, len(rewards), step))

    def update_from_eval(self, lesson_id, rewards, step):
        self.evals.append((lesson_id, len(rewards), step))


@pytest.fixture(scope="module")
def server():
    srv = InferenceServer(InferenceServerConfig(serve_http=False), build_model(TINY), byte_tokenizer(VOCAB)).start()
    yield srv
    srv.shutdown()


def make_manager(server, curriculum=None) -> RolloutManager:
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    return RolloutManager(server, {
        "ok": LessonRuntime(StartsWithA, sampling),
        "raises": LessonRuntime(Raises, sampling),
        "malformed": LessonRuntime(HalfMalformed, sampling),
    }, curriculum)


def test_sample_batch_stamps_weight_step_worker_and_lesson(server):
    manager = make_manager(server)
    batch, metrics = manager.sample_batch("ok", 3, 4, "train", np.random.default_rng(0), weight_step=7,
                                          worker_id="rw-1")
    assert len(batch.groups) == 3 and all(len(g) == 4 for g in batch.groups)
    assert batch.metadata.weight_step == 7 and batch.metadata.worker_id == "rw-1"
    assert {(r.metadata.weight_step, r.metadata.worker_id, r.lesson_id) for r in batch.rollouts} == {(7, "rw-1", "ok")}
    assert metrics["ok/env_failures"] == 0 and metrics["ok/prompts"] == 3
    again, _ = manager.sample_batch("ok", 3, 4, "train", np.random.default_rng(0), weight_step=8, worker_id="rw-2")
    assert again.metadata.weight_step == 8  # nothing about the run is remembered between calls


def test_a_failing_environment_is_reported_not_raised(server):
    manager = make_manager(server)
    batch, metrics = manager.sample_batch("raises", 2, 2, "train", np.random.default_rng(0), 0, "w")
    assert batch is None and metrics["raises/env_failures"] == 1
    batch, metrics = manager.sample_batch("malformed", 3, 2, "train", np.random.default_rng(0), 0, "w")
    assert len(batch.groups) == 3 and metrics["malformed/malformed_groups"] == 2


def test_unknown_lesson_is_a_clear_error(server):
    with pytest.raises(KeyError, match="unknown lesson 'nope'"):
        make_manager(server).sample_batch("nope", 1, 1, "train", np.random.default_rng(0), 0, "w")


def test_full_eval_updates_the_curriculum_and_micro_eval_does_not(server):
    curriculum = RecordingCurriculum()
    manager = make_manager(server, curriculum)
    stats, batch = manager.evaluate_lesson("ok", 4, "micro_eval", np.random.default_rng(0), step=3, weight_step=3,
                                           worker_id="w")
    assert curriculum.evals == [] and stats["n"] == 4
    assert all(r.temperature == 0.0 for r in batch.rollouts) and all(len(g) == 1 for g in batch.groups)
    results = manager.evaluate_curriculum(4, "eval", np.random.default_rng(0), step=5, weight_step=5, worker_id="w")
    assert set(results) == {"ok", "raises", "malformed"}
    assert ("ok", 4, 5) in curriculum.evals and not any(lesson == "raises" for lesson, _, _ in curriculum.evals)
    assert results["raises"][0]["env_failures"] == 1 and results["raises"][1] is None
    batch, _ = manager.sample_batch("ok", 2, 2, "train", np.random.default_rng(0), 5, "w")
    manager.update_training_stats("ok", batch, step=5)
    assert curriculum.training == [("ok", 4, 5)]


def test_greedy_eval_is_deterministic_and_update_model_changes_it(server):
    manager = make_manager(server)
    first, _ = manager.evaluate_lesson("ok", 3, "micro_eval", np.random.default_rng(1), 0, 0, "w")
    second, _ = manager.evaluate_lesson("ok", 3, "micro_eval", np.random.default_rng(1), 0, 0, "w")
    tokens = lambda b: [r.response_tokens.tolist() for r in b.rollouts]  # noqa: E731
    _, b1 = manager.evaluate_lesson("ok", 3, "micro_eval", np.random.default_rng(1), 0, 0, "w")
    original = manager.model
    manager.update_model(build_model(ModelConfig(model=TINY.model, vocab_size=VOCAB, seed=1)), weight_step=1)
    _, b2 = manager.evaluate_lesson("ok", 3, "micro_eval", np.random.default_rng(1), 1, 1, "w")
    manager.update_model(original, weight_step=0)
    _, b3 = manager.evaluate_lesson("ok", 3, "micro_eval", np.random.default_rng(1), 0, 0, "w")
    first.pop("sample_seconds"), second.pop("sample_seconds")
    assert first == second and tokens(b1) == tokens(b3) and tokens(b1) != tokens(b2)


class NaNAfterConstruction(StartsWithA):
    """Writes a NaN into the reward arrays of its first group after building it (a rollout cannot be
    built with one): stamping catches it."""

    def sample(self, *args):
        groups, metrics = super().sample(*args)
        for r in groups[0].rollouts:
            r.token_rewards[-1] = np.nan
        return groups, metrics


class ConstructorRaises:
    def __init__(self):
        raise ValueError("alphabet_size must be <= 26, got 99")


def test_a_nan_reward_drops_its_group_never_the_call(server):
    import faulty_envs

    sampling = SamplingParams(temperature=1.0, max_tokens=2)
    manager = RolloutManager(server, {"nan-after": LessonRuntime(NaNAfterConstruction, sampling),
                                      "nan-grade": LessonRuntime(lambda: faulty_envs.NaNGrader(nan_every=2), sampling)})
    batch, metrics = manager.sample_batch("nan-after", 3, 2, "train", np.random.default_rng(0), 0, "w")
    assert len(batch.groups) == 2 and metrics["nan-after/malformed_groups"] == 1
    assert metrics["nan-after/env_failures"] == 0
    # A SingleTurnEnv grader's NaN for problems 0 and 2 drops those two groups; problem 1 and 3 stay.
    batch, metrics = manager.sample_batch("nan-grade", 4, 2, "train", np.random.default_rng(0), 0, "w")
    assert sorted(g.group_id.split(":")[1] for g in batch.groups) == ["1", "3"]
    assert metrics["nan-grade/malformed_groups"] == 2 and metrics["nan-grade/env_failures"] == 0


def test_an_env_that_fails_to_construct_is_counted_and_named(server):
    manager = RolloutManager(server, {"bad": LessonRuntime(ConstructorRaises, SamplingParams(max_tokens=2),
                                                           env_name="my_envs:ConstructorRaises")})
    batch, metrics = manager.sample_batch("bad", 2, 2, "train", np.random.default_rng(0), 0, "w")
    assert batch is None and metrics["bad/env_failures"] == 1
    stats, batch = manager.evaluate_lesson("bad", 2, "eval", np.random.default_rng(0), 0, 0, "w")
    assert batch is None and stats["env_failures"] == 1 and np.isnan(stats["reward_mean"])
    assert manager.describe_env("bad") == "env 'my_envs:ConstructorRaises'"  # never built: its configured name
