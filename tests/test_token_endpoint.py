"""The token endpoint, `POST /inference/v1/generate` (marinrl/inference/token_endpoint.py): token ids in,
the tokens we sampled, their logprobs and weight steps out, in vLLM's shapes; every field we do not serve
refused with 400 naming it; the API key as on the OpenAI routes. Called with httpx, with the `openai` client
(as the `renderers` package calls it) and with verifiers 0.4's own `TrainClient`, which runs in the verifiers
virtualenv's interpreter (tests/conftest.py's `verifiers_python`: `.venv-verifiers`, which `make test` builds;
tests/verifiers_support.py).

Real server on loopback (the tiny random Llama of tests/test_endpoint_auth.py: compiled shapes come from the
persistent cache), real HTTP, the real verifiers package.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from levanter.models.llama import LlamaConfig
from verifiers_support import run_verifiers_client

from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference.context import SamplingParams, chat_prompt_tokens
from marinrl.inference.openai_api import TokenRequest
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer

ARCH = LlamaConfig(
    seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
    gradient_checkpointing=False,
)
VOCAB = 512
WEIGHT_STEP = 5
PROMPT = [256, 104, 105]  # BOS "hi"


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=0))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory) -> str:
    """The tokenizer on disk, where verifiers' renderer loads it from (it names a model or a directory)."""
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    config = InferenceServerConfig(serve_http=True, default_max_tokens=12)
    with InferenceServer(config, model, tokenizer, weight_step=WEIGHT_STEP) as srv:
        yield srv


def _generate(server, body: dict, key: str | None = None) -> httpx.Response:
    key = server.api_key if key is None else key
    with httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=300) as http:
        return http.post("/inference/v1/generate", json=body, headers={"Authorization": f"Bearer {key}"})


def _reference(server, prompt, *, max_tokens, seed, temperature=1.0, stop_token_ids=()):
    """What the server samples for this prompt and seed, through `generate_requests` as the endpoint calls it."""
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              stop_sequences=tuple((t,) for t in stop_token_ids))
    ((ref,),) = server.generate_requests([TokenRequest(prompt, 1, sampling, seed)],
                                         min_batch=server.config.http_min_batch, stamp_weight_steps=True)
    return ref


# ------------------------------------------------------------------------------ the shapes


def test_the_sampled_tokens_logprobs_and_weight_steps_come_back(server):
    r = _generate(server, {"model": "marinrl-policy", "token_ids": PROMPT,
                           "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1}})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = _reference(server, PROMPT, max_tokens=8, seed=3)
    (choice,) = body["choices"]
    assert body["prompt_token_ids"] == PROMPT and body["request_id"]
    assert choice["token_ids"] == ref.tokens.tolist() and choice["finish_reason"] == ref.finish_reason
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ref.tokens]  # vLLM's token-id names
    # float32 logprobs of the same tokens from one compiled shape: a few ulps of values ~1..10
    np.testing.assert_allclose([c["logprob"] for c in content], ref.logprobs, rtol=1e-5, atol=1e-5)
    assert choice["weight_steps"] == [WEIGHT_STEP] * len(ref.tokens)
    n = len(ref.tokens)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}


def test_stop_token_ids_end_the_turn_on_the_stop_token(server):
    free = _generate(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "seed": 11}}).json()
    tokens = free["choices"][0]["token_ids"]
    assert len(tokens) == 8 and free["choices"][0]["logprobs"] is None  # none asked for
    stop = tokens[3]
    first = tokens.index(stop)
    r = _generate(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "seed": 11,
                                                                    "stop_token_ids": [stop], "logprobs": 0}})
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] == tokens[: first + 1] and choice["finish_reason"] == "stop"  # the stop token kept
    assert len(choice["logprobs"]["content"]) == first + 1


def _split_stop(server, tokenizer, max_tokens: int) -> tuple[int, list[int], str]:
    """A seed, its free tokens and a stop string of two printable characters that the text holds but the
    tokens do not (a special token, dropped from the text, sits between them): only the text cut finds it."""
    for seed in range(100):
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens, "seed": seed}}
        tokens = _generate(server, body).json()["choices"][0]["token_ids"]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        for k in range(len(text) - 1):
            stop = text[k:k + 2]
            ids = tokenizer.encode(stop, add_special_tokens=False)
            if (stop.isascii() and stop.isprintable() and text.find(stop) == k
                    and not any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))):
                return seed, tokens, stop
    raise AssertionError("no seed gave a stop string split by a special token")


def test_a_stop_string_cuts_the_weight_steps_with_the_tokens(server, tokenizer):
    seed, tokens, stop = _split_stop(server, tokenizer, max_tokens=24)
    r = _generate(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 24, "seed": seed, "stop": [stop],
                                                                    "logprobs": 1}})
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and 0 < len(choice["token_ids"]) < len(tokens)
    assert choice["token_ids"] == tokens[:len(choice["token_ids"])]
    assert stop in tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["weight_steps"] == [WEIGHT_STEP] * len(choice["token_ids"])  # cut with them, one per token
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


def test_n_samples_and_the_default_budget(server):
    r = _generate(server, {"token_ids": PROMPT, "sampling_params": {"n": 2, "seed": 1, "temperature": 1.0}})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(len(c["token_ids"]) <= server.config.default_max_tokens for c in choices)
    assert choices[0]["token_ids"] != choices[1]["token_ids"]


def test_a_reload_shows_in_the_weight_steps(server):
    try:
        server.reload(server.model, weight_step=WEIGHT_STEP + 4)
        r = _generate(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "seed": 3}})
        assert r.json()["choices"][0]["weight_steps"] == [WEIGHT_STEP + 4] * 2
    finally:
        server.reload(server.model, weight_step=WEIGHT_STEP)


# ------------------------------------------------------------------------------ refusals and the key


@pytest.mark.parametrize("extra, named", [
    ({"stream": True}, "stream"),
    ({"features": {"mm_hashes": {}}}, "features"),
    ({"content_parts": [], "return_token_ids": True}, "content_parts, return_token_ids"),
    ({"kv_transfer_params": {}}, "kv_transfer_params"),
    ({"sampling_params": {"presence_penalty": 0.5}}, "sampling_params.presence_penalty=0.5"),
    ({"sampling_params": {"min_tokens": 3}}, "sampling_params.min_tokens=3"),
    ({"sampling_params": {"repetition_penalty": 1.1}}, "sampling_params.repetition_penalty=1.1"),
    ({"sampling_params": {"ignore_eos": True}}, "sampling_params.ignore_eos=True"),
    ({"sampling_params": {"logit_bias": {"1": 2.0}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"reasoning_effort": "low"}}, "sampling_params.reasoning_effort='low'"),
    ({"sampling_params": {"logprobs": 5}}, "sampling_params.logprobs=5"),
])
def test_unsupported_fields_are_refused_by_name(server, extra, named):
    extra = dict(extra)
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, **extra.pop("sampling_params", {})}, **extra}
    r = _generate(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("unsupported: ") and named in r.json()["error"]["message"]


@pytest.mark.parametrize("body, named", [
    ({"token_ids": [1, VOCAB]}, f"token_ids holds {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    ({"token_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids holds -1"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens must be >= 1"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 10**12}}, "sampling_params.max_tokens is 1000000000000, "
                                                                    "but the prompt (1 tokens) leaves 127 "),
    ({"token_ids": [1], "sampling_params": {"n": 10**6}}, "sampling_params.n=1000000 x 1 prompt(s)"),
    ({"token_ids": [1], "sampling_params": {"top_k": -2}}, "sampling_params.top_k must be >= 1"),
    ({"token_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p must be in (0, 1]"),
    ({"token_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n must be >= 1"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature must be >= 0"),
    ({"token_ids": []}, "invalid request: token_ids: List should have at least 1 item"),
    ({"prompt": "hi"}, "invalid request: token_ids: Field required"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": "many"}}, "invalid request: sampling_params.max_tokens: "),
])
def test_values_out_of_range_are_refused_by_name(server, body, named):
    r = _generate(server, body)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


def test_fields_that_change_no_sample_are_accepted(server):
    plain = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "seed": 9}}
    noisy = {"token_ids": PROMPT, "cache_salt": "s", "priority": 3, "request_id": "mine",
             "sampling_params": {"max_tokens": 4, "seed": 9, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                 "skip_special_tokens": False, "routed_experts_prompt_start": 2,
                                 "include_stop_str_in_output": False, "repetition_penalty": 1.0}}
    a, b = _generate(server, plain).json(), _generate(server, noisy).json()
    assert b["request_id"] == "mine"
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def test_the_key_is_required(server):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    r = _generate(server, body, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=60) as http:
        assert http.post("/inference/v1/generate", json=body).status_code == 401


def test_the_openai_client_posts_to_it_as_renderers_does(server):
    """`renderers.client.generate` posts with the `openai` client to an absolute URL at the server's root."""
    client = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
    url = f"{str(client.base_url).rstrip('/').removesuffix('/v1')}/inference/v1/generate"
    raw = client.post(url, body={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "seed": 3, "logprobs": 1}},
                      cast_to=httpx.Response)
    assert raw.json()["choices"][0]["token_ids"] == _reference(server, PROMPT, max_tokens=3, seed=3).tokens.tolist()
    with pytest.raises(openai.BadRequestError, match=r"sampling_params\.repetition_penalty=1\.1"):
        client.post(url, body={"token_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.1}},
                    cast_to=httpx.Response)
    assert [m.id for m in client.models.list()] == ["marinrl-policy"]


# ------------------------------------------------------------------------------ verifiers' own client


def test_verifiers_train_client_gets_the_tokens_we_sampled(server, tokenizer, tokenizer_dir, verifiers_python):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ok, refused = run_verifiers_client(verifiers_python, base_url=server.url, api_key=server.api_key,
                                       tokenizer_dir=tokenizer_dir, turns=[
        [messages, {"max_tokens": 6, "temperature": 1.0, "seed": 3}],
        [messages, {"max_tokens": 6, "repetition_penalty": 1.1}],
    ])
    prompt = chat_prompt_tokens(tokenizer, messages)
    assert ok["prompt_ids"] == prompt  # verifiers' renderer made the same prompt our chat template makes
    # the renderer asks to stop on the tokenizer's EOS, which our sampler stops on anyway
    ref = _reference(server, prompt, max_tokens=6, seed=3, stop_token_ids=[tokenizer.eos_token_id])
    assert ok["completion_ids"] == ref.tokens.tolist()
    np.testing.assert_allclose(ok["completion_logprobs"], ref.logprobs, rtol=1e-5, atol=1e-5)
    assert ok["finish_reason"] == ref.finish_reason
    assert refused["status_code"] == 400 and "sampling_params.repetition_penalty=1.1" in refused["error"]
