"""The inference server: exact logprobs (against a full forward pass), seeded sampling, finish reasons,
stop sequences, reload, lifecycle, and the OpenAI-compatible endpoint through the `openai` client.

One small model and one server per module: every distinct shape is a compile of several seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import threading

import equinox as eqx
import haliax as hax
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig

from marinrl.config.model import ModelConfig
from marinrl.config.server import EngineConfig, InferenceServerConfig
from marinrl.inference import sampler as scan_sampler
from marinrl.inference.context import Generation, SamplingParams, chat_prompt_tokens, stop_sequences
from marinrl.inference.levanter_engine import find_stop
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer

ARCH = LlamaConfig(
    seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
    gradient_checkpointing=False,
)
VOCAB = 512
SERVED = "marinrl-policy"  # the model name the endpoint serves (another is refused)
ENGINE = EngineConfig(max_seqs=16, max_seq_len=96, max_prefill_tokens=256)
FWD_LEN = 64  # full-forward reference runs on sequences right-padded to this length (one compile)


def _model(seed: int):
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=seed))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def model():
    return _model(0)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    # the endpoint through Levanter's engine (tests/test_openai_env.py covers it through the scan sampler)
    srv = InferenceServer(InferenceServerConfig(engine=ENGINE, http_backend="engine", serve_http=True), model,
                          tokenizer, weight_step=0).start()
    srv.wait_until_ready()
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def engine_server(model, tokenizer):
    """`generate` through Levanter's engine (same engine shapes as `server`'s endpoint: no new compile)."""
    srv = InferenceServer(InferenceServerConfig(backend="engine", serve_http=False, engine=ENGINE), model, tokenizer)
    srv.start().wait_until_ready()
    yield srv
    srv.shutdown()


@pytest.fixture(params=["scan", "engine"])
def any_server(request):
    return request.getfixturevalue("server" if request.param == "scan" else "engine_server")


@jax.jit
def _forward_logits(model, ids):
    return model(hax.named(ids, ("batch", "position")), attn_mask=AttentionMask.causal()).array


def reference_logprobs(model, prompt, tokens, temperature):
    """log softmax(logits / T) of `tokens` after `prompt`, from one full forward pass (T = 0 reads as 1)."""
    seq = list(prompt) + [int(t) for t in tokens]
    assert len(seq) <= FWD_LEN
    ids = np.zeros((1, FWD_LEN), np.int32)
    ids[0, : len(seq)] = seq
    logits = np.asarray(_forward_logits(model, jnp.asarray(ids)), np.float64)[0]
    t = temperature if temperature > 0 else 1.0
    scaled = logits[len(prompt) - 1 : len(seq) - 1] / t
    logp = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) - scaled.max(
        -1, keepdims=True
    )
    return logp[np.arange(len(tokens)), np.asarray(tokens)], np.argmax(logits[len(prompt) - 1 : len(seq) - 1], -1)


def _prompts(rng, k, lo=2, hi=14):
    return [rng.integers(0, 256, rng.integers(lo, hi)).tolist() for _ in range(k)]


# ------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_a_full_forward_pass(any_server, model, temperature):
    prompts = _prompts(np.random.default_rng(1), 5)
    gens = any_server.generate(prompts, n=3, sampling=SamplingParams(temperature=temperature, max_tokens=20), seed=7)
    assert len(gens) == 5 and all(len(g) == 3 for g in gens)
    n_checked = 0
    for prompt, samples in zip(prompts, gens):
        for g in samples:
            assert g.tokens.dtype == np.int32 and g.logprobs.dtype == np.float32
            assert len(g.tokens) == len(g.logprobs) >= 1
            ref, _ = reference_logprobs(model, prompt, g.tokens, temperature)
            np.testing.assert_allclose(g.logprobs, ref, atol=1e-4, rtol=0)
            n_checked += len(g.tokens)
    assert n_checked >= 5 * 3 * 5
    # the samples of a prompt differ from each other (each has its own key)
    assert len({tuple(g.tokens) for g in gens[0]}) == 3


def test_greedy_follows_the_argmax_of_a_full_forward_pass(any_server, model):
    prompts = _prompts(np.random.default_rng(2), 3)
    gens = any_server.generate(prompts, n=2, sampling=SamplingParams(temperature=0.0, max_tokens=16), seed=0)
    for prompt, (a, b) in zip(prompts, gens):
        np.testing.assert_array_equal(a.tokens, b.tokens)  # greedy: both samples agree
        ref, argmax = reference_logprobs(model, prompt, a.tokens, 0.0)
        np.testing.assert_array_equal(a.tokens, argmax)
        np.testing.assert_allclose(a.logprobs, ref, atol=1e-4, rtol=0)


def test_scan_and_engine_agree_on_greedy_output(server, engine_server):
    prompts = _prompts(np.random.default_rng(3), 4)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    for a, b in zip(server.generate(prompts, 1, sp, 0), engine_server.generate(prompts, 1, sp, 0)):
        np.testing.assert_array_equal(a[0].tokens, b[0].tokens)
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-4)


# ---------------------------------------------------------------------------------------- seeds


def test_same_seed_same_samples_and_different_seed_different(any_server):
    prompts = _prompts(np.random.default_rng(4), 4)
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    a = any_server.generate(prompts, 2, sp, seed=11)
    b = any_server.generate(prompts, 2, sp, seed=11)
    c = any_server.generate(prompts, 2, sp, seed=12)
    flat = lambda gens: [tuple(g.tokens) for row in gens for g in row]  # noqa: E731
    assert flat(a) == flat(b)
    for x, y in zip([g for r in a for g in r], [g for r in b for g in r]):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    assert sum(x != y for x, y in zip(flat(a), flat(c))) >= 6


def test_a_sample_does_not_depend_on_the_other_prompts_of_the_call(server):
    prompts = _prompts(np.random.default_rng(5), 6)
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    alone = server.generate(prompts[:1], 2, sp, seed=3)
    together = server.generate(prompts, 2, sp, seed=3)
    for x, y in zip(alone[0], together[0]):
        np.testing.assert_array_equal(x.tokens, y.tokens)


# ----------------------------------------------------------------------- finish reasons and stops


def _greedy(srv, prompt, max_tokens=24, stops=()):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_sequences=tuple(stops))
    return srv.generate([prompt], 1, sp, seed=0)[0][0]


def _stops_from(tokens):
    """Stop sequences taken from a greedy continuation: single-token, two-token and three-token ones."""
    t = [int(x) for x in tokens]
    return [(t[9],), (t[4], t[5]), (t[12], t[13], t[14])]


def test_length_when_the_budget_runs_out(any_server):
    g = _greedy(any_server, [5, 6, 7], max_tokens=7)
    assert g.finish_reason == "length" and len(g.tokens) == 7


@pytest.mark.parametrize("which", [0, 1, 2])
def test_each_stop_sequence_stops_after_its_first_occurrence(any_server, which):
    prompt = [65, 66, 67, 68]
    full = _greedy(any_server, prompt)
    stop = _stops_from(full.tokens)[which]
    end = find_stop(full.tokens.tolist(), [stop])
    g = _greedy(any_server, prompt, stops=[stop])
    assert g.finish_reason == "stop"
    assert len(g.tokens) == end and tuple(g.tokens[-len(stop):]) == stop
    np.testing.assert_array_equal(g.tokens, full.tokens[:end])
    np.testing.assert_allclose(g.logprobs, full.logprobs[:end], atol=1e-5)


def test_several_stop_sequences_the_first_match_wins(any_server):
    prompt = [65, 66, 67, 68]
    full = _greedy(any_server, prompt)
    stops = _stops_from(full.tokens)
    end = find_stop(full.tokens.tolist(), stops)
    g = _greedy(any_server, prompt, stops=stops[::-1])
    assert g.finish_reason == "stop" and len(g.tokens) == end


def test_stop_sequence_does_not_match_across_the_prompt(any_server):
    prompt = [65, 66, 67, 68]
    full = _greedy(any_server, prompt)
    # (last prompt token, first response token) occurs only across the boundary
    stop = (68, int(full.tokens[0]))
    assert find_stop(full.tokens.tolist(), [stop]) is None, "premise: the pair occurs only across the boundary"
    g = _greedy(any_server, prompt, stops=[stop])
    assert g.finish_reason == "length" and len(g.tokens) == 24


def test_eos_stops_and_is_included(any_server, model, tokenizer):
    """Make EOS the greedy choice (its unembedding row = 2x the argmax token's) and check it ends the turn."""
    prompt = [70, 71, 72]
    first = int(_greedy(any_server, prompt, max_tokens=4).tokens[0])
    w = model.lm_head.weight
    eos = tokenizer.eos_token_id
    rigged = eqx.tree_at(lambda m: m.lm_head.weight, model, w.at["vocab", eos].set(2 * w["vocab", first]))
    any_server.reload(rigged, weight_step=99)
    try:
        g = _greedy(any_server, prompt, max_tokens=8)
    finally:
        any_server.reload(model, weight_step=0)
    assert g.tokens.tolist() == [eos] and g.finish_reason == "stop"


# --------------------------------------------------------------------------------------- reload


def test_reload_changes_greedy_output_and_reverting_restores_it(server, model):
    prompts = _prompts(np.random.default_rng(6), 3)
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    before = server.generate(prompts, 1, sp, 0)
    http = openai.OpenAI(base_url=server.url, api_key=server.api_key)
    http_before = http.completions.create(model=SERVED, prompt=prompts[0], max_tokens=8, temperature=0.0)
    compiled = scan_sampler.compiled_shapes()

    server.reload(_model(1), weight_step=1)
    assert server.weight_step == 1
    other = server.generate(prompts, 1, sp, 0)
    assert any(not np.array_equal(a[0].tokens, b[0].tokens) for a, b in zip(before, other))
    http_other = http.completions.create(model=SERVED, prompt=prompts[0], max_tokens=8, temperature=0.0)
    assert http_other.choices[0].text != http_before.choices[0].text  # the endpoint sees the new weights too

    server.reload(model, weight_step=2)
    after = server.generate(prompts, 1, sp, 0)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a[0].tokens, b[0].tokens)
    assert http.completions.create(model=SERVED, prompt=prompts[0], max_tokens=8,
                                   temperature=0.0).choices[0].text == http_before.choices[0].text
    assert scan_sampler.compiled_shapes() == compiled  # reload recompiled nothing
    assert server.weight_step == 2


def test_reload_refuses_a_different_architecture(server):
    other = build_model(ModelConfig(model=dataclasses.replace(ARCH, intermediate_dim=96), vocab_size=VOCAB))
    with pytest.raises(ValueError, match="reload"):
        server.reload(other, weight_step=5)
    assert server.weight_step != 5


# ------------------------------------------------------------------------------------ batching


def test_many_prompts_in_one_call(any_server):
    """More sequences than the engine has slots: the engine path splits the call; all come back whole."""
    prompts = _prompts(np.random.default_rng(7), 9, lo=3, hi=8)
    gens = any_server.generate(prompts, n=4, sampling=SamplingParams(temperature=1.0, max_tokens=10), seed=1)
    assert len(gens) == 9 and all(len(row) == 4 for row in gens)
    for row in gens:
        for g in row:
            assert (g.finish_reason == "length" and len(g.tokens) == 10) or g.finish_reason == "stop"


def test_bad_prompts_are_clear_errors(server):
    sp = SamplingParams()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        server.generate([[1], []], 1, sp, 0)
    with pytest.raises(ValueError, match="token id 600"):
        server.generate([[1, 600]], 1, sp, 0)
    assert server.generate([], 2, sp, 0) == []


def test_find_stop():
    assert find_stop([1, 2, 3, 4], [(3,)]) == 3
    assert find_stop([1, 2, 3, 4], [(2, 3), (4,)]) == 3
    assert find_stop([1, 2, 3, 4], [(4,), (1, 2)]) == 2
    assert find_stop([1, 2, 3, 4], [(3, 2)]) is None
    assert find_stop([], [(1,)]) is None


# --------------------------------------------------------------------------------- chat helpers


def test_chat_helpers(server, tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    prompt = server.chat_prompt(msgs)
    assert prompt == chat_prompt_tokens(tokenizer, msgs) == [256, 260, 104, 105, 257, 261]
    prompts, gens = server.generate_chat([msgs, msgs], 2, SamplingParams(max_tokens=6), seed=0)
    assert prompts == [prompt, prompt] and len(gens) == 2
    assert isinstance(server.text(gens[0][0]), str)
    assert stop_sequences(tokenizer, ["\n\n", "x"]) == ((10, 10), (120,))
    g = Generation(np.array([104, 105, 257], np.int32), np.zeros(3, np.float32), "stop")
    assert server.text(g) == "hi"


# ------------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)


def test_http_completions_with_logprobs_match_a_full_forward_pass(client, model, tokenizer):
    prompt = "The quick brown"
    r = client.completions.create(model=SERVED, prompt=prompt, max_tokens=10, temperature=0.8, logprobs=1, seed=5)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 10
    ids = tokenizer.convert_tokens_to_ids(choice.logprobs.tokens)
    ref, _ = reference_logprobs(model, tokenizer.encode(prompt, add_special_tokens=False), ids, 0.8)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, ref, atol=1e-4)
    # several prompts, n samples each, in prompt-major order; same seed, same text
    r2 = client.completions.create(model=SERVED, prompt=["ab", "cd"], max_tokens=6, n=3, seed=5)
    assert len(r2.choices) == 6 and [c.index for c in r2.choices] == list(range(6))
    r3 = client.completions.create(model=SERVED, prompt=["ab", "cd"], max_tokens=6, n=3, seed=5)
    assert [c.text for c in r2.choices] == [c.text for c in r3.choices]


def test_http_chat_completions_with_logprobs(client, model, tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=8, temperature=1.0, logprobs=True,
                                       seed=1)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    ids = tokenizer.convert_tokens_to_ids([c.token for c in choice.logprobs.content])
    ref, _ = reference_logprobs(model, chat_prompt_tokens(tokenizer, msgs), ids, 1.0)
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], ref, atol=1e-4)
    assert r.usage.prompt_tokens == len(chat_prompt_tokens(tokenizer, msgs))


def test_http_each_stop_string_works_and_text_ends_before_it(client, tokenizer):
    prompt = [72, 101, 108, 108, 111]  # token prompts work too

    def run(seed, stop=None):
        r = client.completions.create(model=SERVED, prompt=prompt, max_tokens=24, temperature=1.0, seed=seed, stop=stop,
                                      logprobs=1)
        return r.choices[0], tokenizer.convert_tokens_to_ids(r.choices[0].logprobs.tokens)

    # a seed whose continuation holds at least two distinct printable ASCII bytes to use as stop strings
    for seed in range(50):
        full, ids = run(seed)
        printable = list(dict.fromkeys(t for t in ids if 32 <= t < 127 and t != tokenizer.eos_token_id))
        if len(printable) >= 2:
            break
    else:
        raise AssertionError("no seed gave printable bytes")
    for byte in printable[:2]:
        stop = chr(byte)
        c, got = run(seed, stop=[stop, "\x00\x01"])
        first = ids.index(byte)
        assert c.finish_reason == "stop" and stop not in c.text
        assert got == ids[: first + 1]  # the tokens stop right after the stop string's token
        assert c.text == tokenizer.decode(ids[:first], skip_special_tokens=True)


def test_http_refuses_unsupported_options(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=SERVED, prompt="a", max_tokens=2, top_p=0.5)
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        client.completions.create(model=SERVED, prompt="a", max_tokens=1000)


def test_http_health_and_models(server):
    import urllib.request

    base = server.url.removesuffix("/v1")
    assert b"ok" in urllib.request.urlopen(f"{base}/health").read()
    models = urllib.request.Request(f"{server.url}/models", headers={"Authorization": f"Bearer {server.api_key}"})
    (card,) = json.loads(urllib.request.urlopen(models).read())["data"]
    assert card["id"] == "marinrl-policy" and card["max_model_len"] == ENGINE.max_seq_len  # vLLM's extension


def test_http_token_endpoint_through_the_engine(server, client):
    """/inference/v1/generate (tests/test_token_endpoint.py covers it through the scan sampler): the tokens
    /v1/completions samples for the same prompt and seed, each stamped with the engine's weight step."""
    prompt = [256, 104, 105]
    ref = client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, seed=5, logprobs=0).choices[0]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4, "seed": 5, "logprobs": 1}}
    post = functools.partial(client.post, server.url.removesuffix("/v1") + "/inference/v1/generate",
                             cast_to=httpx.Response)
    (choice,) = post(body=body).json()["choices"]
    served = server.weight_step  # the file's server: an earlier test may have reloaded it as another step
    assert choice["token_ids"] == ref.token_ids and choice["weight_steps"] == [served] * len(ref.token_ids)
    np.testing.assert_allclose([c["logprob"] for c in choice["logprobs"]["content"]], ref.logprobs.token_logprobs,
                               rtol=1e-6, atol=1e-6)
    try:
        server.reload(server.model, weight_step=served + 1)
        (choice,) = post(body=body).json()["choices"]
        assert choice["token_ids"] == ref.token_ids and choice["weight_steps"] == [served + 1] * len(ref.token_ids)
    finally:
        server.reload(server.model, weight_step=served)


# ------------------------------------------------------------------------------------- lifecycle


def test_shutdown_leaves_no_thread_or_port(model, tokenizer):
    before = {t.ident for t in threading.enumerate()}
    srv = InferenceServer(InferenceServerConfig(engine=ENGINE, serve_http=True), model, tokenizer)
    with pytest.raises(RuntimeError, match="start"):
        srv.wait_until_ready()
    srv.start()
    srv.wait_until_ready(timeout=60)
    port = int(srv.url.rsplit(":", 1)[1].split("/")[0])
    r = openai.OpenAI(base_url=srv.url, api_key=srv.api_key).completions.create(model=SERVED, prompt="x", max_tokens=2)
    assert len(r.choices) == 1
    srv.shutdown()
    srv.shutdown()  # idempotent
    assert {t.ident for t in threading.enumerate()} <= before
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    with socket.socket() as s:  # nothing listens there: a new server can bind it (TIME_WAIT aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    with pytest.raises(RuntimeError, match="start"):
        srv.generate([[1]], 1, SamplingParams(), 0)


def test_context_manager_and_no_http(model, tokenizer):
    cfg = InferenceServerConfig(serve_http=False)
    with InferenceServer(cfg, model, tokenizer) as srv:
        assert len(srv.generate([[1, 2]], 1, SamplingParams(max_tokens=4), 0)[0][0].tokens) >= 1
        with pytest.raises(RuntimeError, match="endpoint"):
            _ = srv.url


# ------------------------------------------------------------------------------ scan sampler parts


def test_scan_sampler_chunks_give_the_same_samples(model):
    prompts = _prompts(np.random.default_rng(8), 5)
    kw = dict(n=2, temperature=1.0, max_tokens=8, stop_sequences=[(257,)], seed=4)
    whole = scan_sampler.sample(model, prompts, **kw)
    chunked = scan_sampler.sample(model, prompts, max_cache_bytes=1, **kw)  # one prompt per device call
    np.testing.assert_array_equal(whole.tokens, chunked.tokens)
    np.testing.assert_array_equal(whole.lengths, chunked.lengths)
    np.testing.assert_allclose(whole.logprobs, chunked.logprobs, atol=1e-5)


def test_inverse_cdf_sampling_follows_the_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=37).astype(np.float32) * 2
    logits[5] = -np.inf  # a zero-probability token is never drawn
    rows = 40000
    u = jnp.asarray(rng.random(rows, dtype=np.float32))
    tokens, logp = jax.jit(scan_sampler._pick, static_argnames="greedy")(
        jnp.broadcast_to(jnp.asarray(logits), (rows, 37)), jnp.float32(1.5), u, greedy=False)
    tokens = np.asarray(tokens)
    p = np.exp(logits / 1.5 - np.logaddexp.reduce(logits / 1.5))
    freq = np.bincount(tokens, minlength=37) / rows
    assert freq[5] == 0
    tolerance = 5 * np.sqrt(p * (1 - p) / rows) + 1e-4  # 5 standard errors
    assert np.all(np.abs(freq - p) <= tolerance), np.abs(freq - p) / tolerance
    np.testing.assert_allclose(np.asarray(logp), np.log(p[tokens]), atol=1e-5)
    # the edges of [0, 1): the first and the last token with nonzero probability
    edge, _ = scan_sampler._pick(jnp.asarray([logits, logits]), jnp.float32(1.0),
                                 jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0))]), False)
    nonzero = np.flatnonzero(np.isfinite(logits))
    assert np.asarray(edge).tolist() == [nonzero[0], nonzero[-1]]


def test_blockwise_cumsum():
    x = np.random.default_rng(1).random((3, 70)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(scan_sampler._cumsum_last(jnp.asarray(x), block=16)), np.cumsum(x, -1),
                               rtol=1e-5)
