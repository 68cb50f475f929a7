"""What the OpenAI routes and the token endpoint do with a request (marinrl/inference/openai_requests.py,
generate_queue.py, the sampler's `_pick`): `top_k`, `top_p` and `min_p` honoured with the logprobs of the
distribution sampled from; what cannot be honoured refused by name, another model refused; `max_tokens` checked
against the model's context and the rows of a request against the endpoint's limit and the KV cache budget, all
before any work; a long generation interleaved with the short requests queued behind it; a stop that answers
the requests in hand.

Real server on loopback (a tiny random Llama with a 512-token context), real HTTP, the `openai` client.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference import sampler as scan_sampler
from marinrl.inference import server as server_module
from marinrl.inference.openai_requests import MAX_ROWS_PER_REQUEST
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer

ARCH = LlamaConfig(seq_len=512, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   gradient_checkpointing=False)
VOCAB = 512
NAME = "marinrl-policy"
PROMPT = [256, 104, 105]  # BOS "hi"
CACHE_BUDGET = 8 << 20  # one call's KV cache: n=200 rows of 400 tokens (45 MB) do not fit, the tests' calls do
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=0))


@pytest.fixture(scope="module")
def server(model):
    config = InferenceServerConfig(serve_http=True, default_max_tokens=12, scan_max_cache_bytes=CACHE_BUDGET)
    with InferenceServer(config, model, byte_tokenizer(VOCAB)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=600)


def _health(server) -> dict:
    return httpx.get(server.url.removesuffix("/v1") + "/health", timeout=60).json()


def _wait_until(condition, what: str, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.01)


# ------------------------------------------------------------------------------ the filters, exactly


def _kept(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The filters' kept set by hand, in vLLM's order: min_p, top_k, then top_p over what they keep."""
    p = np.exp(logits / temperature - np.logaddexp.reduce(logits / temperature))
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(p.shape, bool)
    keep[order[:top_k or len(p)]] = True
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    mass = 0.0
    for i in order:
        if keep[i] and mass >= top_p:
            keep[i] = False
        mass += q[i] if keep[i] else 0.0
    return keep


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (5, 0.8, 0.05)])
def test_the_filters_sample_their_renormalized_distribution_with_its_logprobs(top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=37) * 2).astype(np.float32)
    rows, temperature = 20000, 1.3
    keep = _kept(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    p = np.exp(logits / temperature - np.logaddexp.reduce(logits / temperature))
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    tokens, logp = jax.jit(scan_sampler._pick, static_argnames="greedy")(
        jnp.broadcast_to(jnp.asarray(logits), (rows, 37)), scan_sampler.picking(temperature, top_k, top_p, min_p),
        jnp.asarray(rng.random(rows, dtype=np.float32)), greedy=False)
    tokens = np.asarray(tokens)
    assert keep[tokens].all() and 1 <= keep.sum() < 37
    np.testing.assert_allclose(np.asarray(logp), np.log(q[tokens]), atol=1e-5)  # the distribution sampled from
    freq = np.bincount(tokens, minlength=37) / rows
    assert np.all(np.abs(freq - q) <= 5 * np.sqrt(q * (1 - q) / rows) + 1e-4)


@pytest.mark.parametrize("route", ["chat", "completions", "tokens"])
@pytest.mark.parametrize("only_the_likeliest", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}])
def test_a_filter_that_keeps_only_the_likeliest_token_samples_the_greedy_tokens(server, client, route,
                                                                                only_the_likeliest):
    def call(temperature, extra):
        if route == "chat":
            r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=temperature,
                                               seed=2, logprobs=True, extra_body=extra)
            return r.choices[0].token_ids, [c.logprob for c in r.choices[0].logprobs.content]
        if route == "completions":
            r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=temperature, seed=2,
                                          logprobs=1, extra_body=extra)
            return r.choices[0].token_ids, r.choices[0].logprobs.token_logprobs
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": temperature, "seed": 2,
                                                         "logprobs": 1, **extra}}
        (c,) = client.post(server.url.removesuffix("/v1") + "/inference/v1/generate", body=body,
                           cast_to=httpx.Response).json()["choices"]
        return c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]]

    greedy, _ = call(0.0, {})
    tokens, logprobs = call(1.0, only_the_likeliest)
    assert tokens == greedy
    np.testing.assert_allclose(logprobs, 0.0, atol=1e-6)  # the one token kept has probability 1


def test_a_seed_gives_the_same_filtered_samples(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, logprobs=1, extra_body={"top_p": 0.9})
    a, b, c = (client.completions.create(seed=s, **kw).choices[0].token_ids for s in (4, 4, 5))
    assert a == b and a != c


# ------------------------------------------------------------------------------ refusals, before any work


@pytest.mark.parametrize("extra, named", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence/frequency penalties"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_k": -2}, "top_k must be >= 1"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
])
def test_what_cannot_be_honoured_is_refused_by_name(server, client, extra, named):
    rounds = _health(server)["rounds"]
    with pytest.raises(openai.BadRequestError, match=named.replace("(", r"\(").replace("[", r"\[")):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert _health(server)["rounds"] == rounds  # refused before the generate thread saw it


def test_no_op_values_and_ignored_fields_are_served(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, user="me",
                                       response_format={"type": "text"}, extra_body={"top_k": -1, "tools": []})
    assert len(r.choices[0].token_ids) <= 2


@pytest.mark.parametrize("route", ["chat", "completions", "tokens"])
def test_another_model_is_refused(server, client, route):
    with pytest.raises(openai.NotFoundError, match=f"model 'gpt-4o' is not served here: this endpoint serves '{NAME}'"):
        if route == "chat":
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
        elif route == "completions":
            client.completions.create(model="gpt-4o", prompt="a", max_tokens=2)
        else:
            client.post(server.url.removesuffix("/v1") + "/inference/v1/generate", cast_to=httpx.Response,
                        body={"model": "gpt-4o", "token_ids": PROMPT})


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value, says", [
    (0, "must be >= 1, got 0"), (-1, "must be >= 1, got -1"),
    (10**12, "is 1000000000000, but the prompt"), (10**9, "is 1000000000, but the prompt"),
    (600, "is 600, but the prompt"),
])
def test_max_tokens_is_checked_against_the_context_before_any_work(server, client, field, value, says):
    rounds = _health(server)["rounds"]
    with pytest.raises(openai.BadRequestError, match=f"{field} {says}"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, **{field: value})
    if field == "max_tokens":
        with pytest.raises(openai.BadRequestError, match=f"max_tokens {says}"):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=value)
    assert _health(server)["rounds"] == rounds and _health(server)["status"] == "ok"


def test_a_budget_over_the_context_names_what_fits_and_the_default_is_cut_to_it(client):
    with pytest.raises(openai.BadRequestError, match=r"leaves 509 of the model's context of 512 tokens .*<= 509"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=510)
    assert len(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=509, temperature=0.0,
                                         seed=0).choices[0].token_ids) <= 509
    near_full = [256] + [97] * 506  # 507 tokens: 5 left, under the default budget of 12
    r = client.completions.create(model=NAME, prompt=near_full, seed=1)
    assert len(r.choices[0].token_ids) <= 5


def test_the_rows_of_a_request_are_bounded_before_any_work(server, client):
    rounds = _health(server)["rounds"]
    with pytest.raises(openai.BadRequestError, match=f"n=1000000 x 1 prompt.* over the endpoint's "
                                                     f"{MAX_ROWS_PER_REQUEST} a request"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, n=1_000_000)
    with pytest.raises(openai.BadRequestError, match="n=200 x 2 prompt"):
        client.completions.create(model=NAME, prompt=["a", "b"], max_tokens=2, n=200)
    with pytest.raises(openai.BadRequestError, match=r"n=200 samples .* GiB of KV cache .*ask for n <= \d+"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=400, n=200)
    assert _health(server)["rounds"] == rounds


# ------------------------------------------------------------------------------ one queue, no starvation


def test_short_requests_answer_while_a_long_one_runs(server, client, monkeypatch):
    """A long generation and 16 short requests at once: the short ones are served between the long one's
    chunks (8 decode steps a call here: 63 of them for 500 tokens), so all of them answer before it does."""
    monkeypatch.setattr(server_module, "HTTP_CHUNK_TOKENS", 8)
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        long = pool.submit(client.completions.create, model=NAME, prompt=PROMPT, max_tokens=500, temperature=1.0,
                           seed=LONG_SEED)
        _wait_until(lambda: _health(server)["requests_in_hand"] >= 1, "the long request in hand")
        shorts = [pool.submit(client.completions.create, model=NAME, prompt=[256, 97 + i], max_tokens=4, seed=i)
                  for i in range(16)]
        answered = [f.result() for f in shorts]
        assert not long.done()  # every short one answered while the long one was still generating
        done = long.result()
    assert all(1 <= len(r.choices[0].token_ids) <= 4 for r in answered)
    assert done.choices[0].finish_reason == "length" and len(done.choices[0].token_ids) == 500


LONG_SEED = 1
"""A seed whose 500 tokens hold no EOS (the long request runs its whole budget)."""


def test_a_stop_answers_the_requests_in_hand_and_leaves_no_thread(model):
    config = InferenceServerConfig(serve_http=True, default_max_tokens=12)
    srv = InferenceServer(config, model, byte_tokenizer(VOCAB)).start()
    srv.wait_until_ready()
    client = openai.OpenAI(base_url=srv.url, api_key=srv.api_key, max_retries=0, timeout=600)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.completions.create, model=NAME, prompt=PROMPT, max_tokens=500, seed=LONG_SEED)
        _wait_until(lambda: _health(srv)["requests_in_hand"] >= 1, "the long request in hand")
        srv.shutdown()
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as e:
            long.result()
    if isinstance(e.value, openai.APIStatusError):
        assert e.value.status_code == 503 and "stopped before this request was served" in str(e.value)
