"""A rollout worker's `lora` policy models on one base (`rollout/shared_base.py`, docs/policies.md): one server and
one adapter stack for the `lora` models of one base, a slot each, next to a `full` model's server of its own;
each policy samples the base with its own adapter; a weight version of one policy, received through its own
weight stream, changes only that policy's generations and weight step. The rollout host is built as a Ray
rollout actor builds it (`job/plan.build_rollout_host`), with no Ray and no trainer: versions are published here.

The float32 bound is tests/test_adapter_stack.py's: merged and unmerged sum in another order, so a logprob may
differ by 2·eps·layers·(hidden + intermediate + 2·rank)·scale, scale the largest |logprob|."""

from __future__ import annotations

import numpy as np
import pytest
from test_adapter_stack import random_adapter, reference_logprobs
from test_job import job_config
from test_policy_models import ROLES
from test_train_worker import EPS32

from marinrl.config.curriculum import CurriculumConfig
from marinrl.config.lora import LoraRLConfig
from marinrl.config.policies import PolicyConfig, policy_models
from marinrl.inference import sampler
from marinrl.inference.context import SamplingParams
from marinrl.inference.generate_queue import TokenRequest
from marinrl.job.plan import build_rollout_host
from marinrl.models.lora import AdapterMergingClient, merge_adapters
from marinrl.rollout.shared_base import PolicySlot, SharedBaseServer
from marinrl.transfer.endpoints import build_server

RANK = 4  # test_adapter_stack.random_adapter's rank (every linear module adapted)
POLICIES = {"policy": PolicyConfig(specialization="full"),
            "other": PolicyConfig(specialization="lora", lora=LoraRLConfig(rank=RANK, alpha=8.0)),
            "third": PolicyConfig(specialization="lora", lora=LoraRLConfig(rank=RANK, alpha=4.0))}
PROMPTS = [[3, 17, 4], [9, 2, 11, 40, 5], [7, 7], [30, 1, 2, 3, 4]]
SAMPLING = SamplingParams(max_tokens=10, temperature=1.0)
N, SEED = 2, 11


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    cfg = job_config(tmp_path_factory.mktemp("shared"), curriculum=CurriculumConfig(lessons=(ROLES,)),
                     policies=POLICIES)
    built = build_rollout_host(cfg, 0)
    built.job = cfg
    yield built
    built.server.shutdown()


def _publish(host, name: str, adapter, step: int):
    """A version of policy model `name` through its own weight stream, received by the host's client and handed
    to its server as the rollout worker does (`RolloutManager.update_model`)."""
    (model,) = [m for m in policy_models(host.job) if m.name == name]
    build_server(model.weights).publish(adapter, step)
    update = host.clients[name].poll()
    assert update is not None and update.weight_step == step
    host.server.reload(update.model, update.weight_step, name)


def _bound(base, logprobs) -> float:
    cfg = base.config
    return 2 * EPS32 * cfg.num_layers * (cfg.hidden_dim + cfg.intermediate_dim + 2 * RANK) * max(
        1.0, float(np.max(np.abs(logprobs))))


def _generate(host, policy: str):
    return host.server.for_policy(policy).generate(PROMPTS, N, SAMPLING, SEED)


def _tokens(gens) -> list[list[int]]:
    return [g.tokens.tolist() for row in gens for g in row]


def test_the_lora_policies_of_one_base_share_one_server(host):
    full, other, third = (host.servers[n] for n in POLICIES)
    assert isinstance(other, PolicySlot) and isinstance(third, PolicySlot)
    assert other.server is third.server and isinstance(other.server, SharedBaseServer)  # one server
    assert (other.slot, third.slot) == (0, 1) and other.server.stack.slots == 2  # a slot each, in the job's order
    assert other.model is third.model is other.server.stack.base  # one copy of the base, not one per policy
    assert not isinstance(full, PolicySlot) and full is not other.server and full.model is not other.model
    assert host.server.for_policy("other") is other and host.server.for_policy("policy") is full
    # adapter-only versions received as they are (written into the slot), not merged into a copy of the base
    assert not any(isinstance(c, AdapterMergingClient) for c in host.clients.values())


def test_each_policy_samples_the_base_with_its_own_adapter_and_a_version_touches_only_its_own(host):
    server = host.servers["other"].server
    base = server.model
    adapters = {"other": random_adapter(base, 1), "third": random_adapter(base, 2)}
    for step, (name, adapter) in enumerate(adapters.items(), start=3):
        _publish(host, name, adapter, step)
    assert (host.servers["other"].weight_step, host.servers["third"].weight_step) == (3, 4)
    stops = server._stops(SAMPLING)
    got = {name: _generate(host, name) for name in adapters}
    assert _tokens(got["other"]) != _tokens(got["third"])
    apart = []
    for name, gens in got.items():
        slot = host.servers[name].slot
        adapted = server.stack.adapted(slot)  # the base with this slot's adapter, at its own alpha / rank
        assert float(server.stack.adapters.scales[slot]) == POLICIES[name].lora.scale
        # merge-then-sample: what the rollout side ran before the stack
        ref = sampler.sample(merge_adapters(adapted), PROMPTS, n=N, temperature=SAMPLING.temperature,
                             max_tokens=SAMPLING.max_tokens, stop_sequences=stops, seed=SEED)
        assert _tokens(gens) == [ref.tokens[r, :ref.lengths[r]].tolist() for r in range(len(PROMPTS) * N)]
        logprobs = np.concatenate([g.logprobs for row in gens for g in row])
        want = np.concatenate([ref.logprobs[r, :ref.lengths[r]] for r in range(len(PROMPTS) * N)])
        assert np.max(np.abs(logprobs - want)) <= _bound(base, want)
        # a full forward pass of the base with this adapter (Levanter's own modules), and not with the other's
        other = server.stack.adapted(1 - slot)
        for i, prompt in enumerate(PROMPTS):
            for g in gens[i]:
                full = reference_logprobs(adapted, prompt, g.tokens, SAMPLING.temperature)
                np.testing.assert_allclose(g.logprobs, full, atol=1e-4, rtol=0)
                apart.append(np.max(np.abs(reference_logprobs(other, prompt, g.tokens, SAMPLING.temperature) - full)))
    assert min(apart) > 0.05  # the adapters matter: a row routed to the wrong slot would fail the check above

    # both policies in one sampler call: each row as its own policy's call gave it
    mixed = server.generate_requests([TokenRequest(p, N, SAMPLING, SEED, i, adapter=host.servers[name].slot)
                                      for name in adapters for i, p in enumerate(PROMPTS)])
    assert _tokens(mixed) == _tokens(got["other"]) + _tokens(got["third"])

    # a new version of `third` only: its slot and weight step; `other` samples bit-identically
    full_before = _generate(host, "policy")
    _publish(host, "third", random_adapter(base, 5), 9)
    assert (host.servers["other"].weight_step, host.servers["third"].weight_step) == (3, 9)
    after = {name: _generate(host, name) for name in adapters}
    assert _tokens(after["third"]) != _tokens(got["third"])
    for a, b in zip(after["other"], got["other"]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
    assert _tokens(_generate(host, "policy")) == _tokens(full_before)  # the full model's server: untouched
