"""PolicyRouter (marinrl/rollout/policy_router.py) on two real inference servers with different weights:
each policy's turns are sampled by its model's server, unnamed calls and unknown policies by the first
model's, new weights reach only the named server, and a batch is split into one per model."""

from __future__ import annotations

import numpy as np
import pytest
from test_replay import make_group

from marinrl.inference.context import SamplingParams, policy_context
from marinrl.rollout.policy_router import PolicyRouter, split_by_model
from marinrl.types import RolloutBatch, RolloutGroup, RolloutMetadata

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def other_server(tiny_server):
    """A second server: the session server's architecture and tokenizer, other random weights."""
    from marinrl.config.model import ModelConfig
    from marinrl.config.server import InferenceServerConfig
    from marinrl.inference.server import InferenceServer
    from marinrl.models.policy_model import build_model

    model = build_model(ModelConfig(model=tiny_server.model.config, vocab_size=512, seed=1))
    with InferenceServer(InferenceServerConfig(serve_http=False), model, tiny_server.tokenizer,
                         weight_step=7) as server:
        yield server


def _logprobs(ctx) -> np.ndarray:
    return np.concatenate([g.logprobs for gens in ctx.generate(PROMPTS, 1, GREEDY, seed=0) for g in gens])


def test_each_policy_is_sampled_by_its_models_server(tiny_server, other_server):
    router = PolicyRouter({"writer": other_server, "critic": tiny_server}, {"alice": "writer", "bob": "critic"})
    writer, critic = _logprobs(other_server), _logprobs(tiny_server)
    assert not np.allclose(writer, critic)  # the two models are told apart by what they sample
    assert policy_context(router, "alice") is other_server and policy_context(router, "bob") is tiny_server
    np.testing.assert_array_equal(_logprobs(policy_context(router, "bob")), critic)
    np.testing.assert_array_equal(_logprobs(policy_context(router, "alice")), writer)
    # Unnamed calls, the tokenizer and a policy no model plays: the first model's
    np.testing.assert_array_equal(_logprobs(router), writer)
    assert policy_context(router, "carol") is other_server and router.model is other_server.model
    assert policy_context(tiny_server, "alice") is tiny_server  # one model: no router, the context itself


def test_new_weights_reach_only_the_named_models_server(tiny_server, other_server):
    router = PolicyRouter({"writer": other_server, "critic": tiny_server}, {"alice": "writer", "bob": "critic"})
    critic_step = tiny_server.weight_step
    router.reload(other_server.model, 8, "writer")
    assert (other_server.weight_step, tiny_server.weight_step) == (8, critic_step)
    router.reload(other_server.model, 9)  # unnamed: the first model's
    assert (other_server.weight_step, tiny_server.weight_step) == (9, critic_step)


def test_a_policy_mapped_to_a_model_without_a_server_is_refused(tiny_server):
    with pytest.raises(ValueError, match=r"models without a server: \['ghost'\]"):
        PolicyRouter({"critic": tiny_server}, {"bob": "ghost"})
    with pytest.raises(ValueError, match="at least one server"):
        PolicyRouter({}, {})


def test_a_batch_is_split_into_one_per_model_stamped_with_its_models_weight_step():
    groups = [make_group("g-alice", [0.0, 1.0], w=3, policy="alice"),
              make_group("g-bob", [1.0, 0.0], w=3, policy="bob"),
              make_group("g-carol", [0.5, 0.5], w=3, policy="carol"),
              make_group("g-alice-2", [0.0, 1.0], w=3, policy="alice")]
    batch = RolloutBatch(tuple(groups), RolloutMetadata("w0", 3, 1000.0))
    split = split_by_model(batch, {"alice": "writer", "bob": "critic"}, {"writer": 3, "critic": 5, "idle": 1})
    assert [name for name, _ in split] == ["writer", "critic"]  # the models' order; none for a model without groups
    (_, writer), (_, critic) = split
    assert [g.group_id for g in writer.groups] == ["g-alice", "g-carol", "g-alice-2"]  # unknown policy: first model
    assert [g.group_id for g in critic.groups] == ["g-bob"]
    assert writer.metadata.weight_step == 3 and critic.metadata.weight_step == 5
    assert all(r.metadata.weight_step == 5 for g in critic.groups for r in g.rollouts)
    assert {r.policy_name for g in critic.groups for r in g.rollouts} == {"bob"}
    assert isinstance(critic.groups[0], RolloutGroup) and critic.metadata.worker_id == "w0"
