"""In-flight weight updates: the scan sampler swaps weights between chunks of decode steps, every token
records the weight step that sampled it, and its logprob is that of the weights that produced it; a
multi-turn episode may span a swap; on-policy never mixes versions."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig

from marinrl.config.inflight import InflightConfig
from marinrl.config.model import ModelConfig
from marinrl.config.rollout_worker import RolloutWorkerConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.envs import Feedback, MultiTurnEnv, Problem, safe_sample
from marinrl.inference import sampler as scan_sampler
from marinrl.inference.context import SamplingParams
from marinrl.inference.inflight import WeightSwaps
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutMetadata

ARCH = LlamaConfig(seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
VOCAB = 512
FWD_LEN = 64
LOGPROB_ATOL = 1e-4
"""Logprobs are float32 values of magnitude ~log(VOCAB) ≈ 6 that went through two different programs (a
cached decode and a full forward pass): a few hundred ulps (6 × 1.2e-7 × ~100), as tests/test_inference.py."""


def _model(seed: int):
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=seed))


@pytest.fixture(scope="module")
def models():
    return _model(0), _model(1)


@jax.jit
def _forward_logits(model, ids):
    return model(hax.named(ids, ("batch", "position")), attn_mask=AttentionMask.causal()).array


def reference_logprobs(model, prompt, tokens, temperature):
    """log softmax(logits / T) of each of `tokens` after `prompt`, from one full forward pass of `model`."""
    seq = list(prompt) + [int(t) for t in tokens]
    ids = np.zeros((1, FWD_LEN), np.int32)
    ids[0, :len(seq)] = seq
    logits = np.asarray(_forward_logits(model, jnp.asarray(ids)), np.float64)[0]
    scaled = logits[len(prompt) - 1:len(seq) - 1] / temperature
    scaled -= scaled.max(-1, keepdims=True)
    logp = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
    return logp[np.arange(len(tokens)), np.asarray(tokens)]


class SwapAt:
    """A weight source that has `model` (as `step`) from its `at`-th poll on; counts polls."""

    def __init__(self, model, step: int, at: int):
        self.model, self.step, self.at, self.polls = model, step, at, 0

    def __call__(self):
        self.polls += 1
        return (self.model, self.step) if self.polls >= self.at else None


PROMPTS = [[5, 17, 200, 3], [9, 9, 1, 42, 100, 7, 8]]
KW = dict(n=2, temperature=1.0, max_tokens=12, stop_sequences=[], seed=3)
EVERY = 4


def _sample_with_swap(models, kv):
    old, new = models
    source = SwapAt(new, 1, at=2)  # poll 1: before the prefill; poll 2: after the first chunk of 4 tokens
    swaps = WeightSwaps(source, old, 0, every_tokens=EVERY, kv=kv)
    out = scan_sampler.sample(old, PROMPTS, swaps=swaps, **KW)
    assert swaps.step == 1 and swaps.swaps == 1 and swaps.model is new
    return out


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_a_generation_that_spans_a_swap_stamps_each_token_with_the_weights_that_sampled_it(models, kv):
    old, new = models
    out = _sample_with_swap(models, kv)
    assert out.weight_steps.shape == out.tokens.shape and out.weight_steps.dtype == np.int64
    for r in range(len(PROMPTS) * KW["n"]):
        assert out.lengths[r] == KW["max_tokens"]
        assert out.weight_steps[r].tolist() == [0] * EVERY + [1] * (KW["max_tokens"] - EVERY)
        prompt, tokens, logprobs = PROMPTS[r // KW["n"]], out.tokens[r], out.logprobs[r]
        before = reference_logprobs(old, prompt, tokens, 1.0)
        np.testing.assert_allclose(logprobs[:EVERY], before[:EVERY], atol=LOGPROB_ATOL, rtol=0)
        after = reference_logprobs(new, prompt, tokens, 1.0)
        if kv == "recompute":  # the new weights rebuilt the cache: exactly their forward pass
            np.testing.assert_allclose(logprobs[EVERY:], after[EVERY:], atol=LOGPROB_ATOL, rtol=0)
        else:  # the new weights attend to the old weights' keys and values: neither model's forward pass
            assert np.abs(logprobs[EVERY:] - after[EVERY:]).max() > 100 * LOGPROB_ATOL
            assert np.abs(logprobs[EVERY:] - before[EVERY:]).max() > 100 * LOGPROB_ATOL


@pytest.mark.parametrize("every, polls_after", [(3, [3, 6, 9]), (1, list(range(1, 12)))])
def test_chunks_without_a_swap_give_the_samples_of_one_call(models, every, polls_after):
    old, _ = models
    whole = scan_sampler.sample(old, PROMPTS, **KW)
    source = SwapAt(None, 1, at=10**9)
    chunked = scan_sampler.sample(old, PROMPTS, swaps=WeightSwaps(source, old, 7, every_tokens=every), **KW)
    assert source.polls == 1 + len(polls_after)  # before the prefill, then after those tokens (12 in all)
    np.testing.assert_array_equal(whole.tokens, chunked.tokens)
    np.testing.assert_allclose(whole.logprobs, chunked.logprobs, atol=1e-6, rtol=0)
    assert whole.weight_steps is None and np.all(chunked.weight_steps == 7)


class TalkEnv(MultiTurnEnv):
    """Every turn answered with "ok" until the turn budget: episodes always have several turns."""

    env_name = "talk"
    max_turns = 2
    max_episode_tokens = 40

    def problems(self, n, rng, mode):
        return [Problem(prompt="hi", answer="", example_id=str(i)) for i in range(n)]

    def step(self, problem, actions):
        return Feedback(reward=0.5, observation="ok")


def test_a_multi_turn_episode_spans_a_swap_and_each_turn_is_stamped_by_what_sampled_it(models):
    old, new = models
    server = InferenceServer(InferenceServerConfig(), old, byte_tokenizer(VOCAB), weight_step=4).start()
    source = SwapAt(new, 5, at=2)  # turns are 6 tokens, chunks 16: one poll per turn, at its start
    with server.inflight_updates(source, InflightConfig(enabled=True, swap_every_tokens=16)):
        groups, _ = safe_sample(TalkEnv(), server, lesson_id="talk", n_examples=2, n_generations=2,
                                sampling=SamplingParams(max_tokens=6), rng=np.random.default_rng(0), mode="train",
                                metadata=RolloutMetadata("w", 4))
    assert source.polls == 2 and server.weight_step == 5 and server.model is not old
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 4
    for r in rollouts:
        steps, mask = r.token_weight_steps, r.loss_mask
        first_turn_end = int(np.flatnonzero(~mask)[0])  # the observation after turn 1
        assert steps[:first_turn_end].tolist() == [4] * first_turn_end  # turn 1: the old weights
        assert np.all(steps[~mask] == 4)  # the observation: the step of the token before it
        second_turn = np.flatnonzero(mask)[np.flatnonzero(mask) > first_turn_end]
        assert second_turn.size and np.all(steps[second_turn] == 5)  # turn 2: the new weights
        assert r.metadata.weight_step == 4
    # outside the context the server is back to plain generate: no stamps, no polls
    (gen,), = server.generate([[1, 2, 3]], 1, SamplingParams(max_tokens=4), seed=0)
    assert gen.weight_steps is None and source.polls == 2
    server.shutdown()


def test_on_policy_is_refused_with_in_flight_updates():
    with pytest.raises(ValueError, match="inflight.enabled.*max_staleness 0"):
        RolloutWorkerConfig(max_staleness=0, inflight=InflightConfig(enabled=True))
    RolloutWorkerConfig(max_staleness=0, inflight=InflightConfig(enabled=False))  # off: fine


def test_bad_inflight_settings_name_the_field():
    with pytest.raises(ValueError, match="inflight.swap_every_tokens"):
        InflightConfig(swap_every_tokens=0)
    with pytest.raises(ValueError, match="inflight.kv"):
        InflightConfig(kv="reuse")
    with pytest.raises(ValueError, match="backend: scan"):
        server = InferenceServer(InferenceServerConfig(backend="engine"), _model(0), byte_tokenizer(VOCAB))
        with server.inflight_updates(lambda: None, InflightConfig(enabled=True)):
            pass
