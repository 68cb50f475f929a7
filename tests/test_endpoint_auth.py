"""The OpenAI-compatible endpoint's API key: every request but `/health` needs `Authorization: Bearer
<key>` (401 in OpenAI's format otherwise), in-process agents get the key without asking, a server
without a configured key makes its own per start, the key never reaches a log or a response, and a
non-loopback host without a configured key is refused when the config is built.

Real servers on loopback, real HTTP (httpx and the `openai` client). The architecture and request
shapes are tests/test_openai_env.py's, so compiled shapes come from the persistent cache.
"""

from __future__ import annotations

import functools
import logging
import socket

import draccus
import httpx
import numpy as np
import openai
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.env import EnvConfig
from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.envs import safe_sample
from marinrl.envs.base import make_env, with_endpoint_if_needed
from marinrl.envs.openai_agents import EchoChatAgent
from marinrl.envs.openai_env import OpenAIAgentEnv
from marinrl.inference.context import SamplingParams, chat_prompt_tokens
from marinrl.inference.server import InferenceServer
from marinrl.job.rl_job import RLJobConfig
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.rollout.manager import LessonRuntime, RolloutManager
from marinrl.types import RolloutMetadata

ARCH = LlamaConfig(
    seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
    gradient_checkpointing=False,
)
VOCAB = 512
SERVED = "marinrl-policy"  # the model name the endpoint serves (another is refused)
KEY = "test-key-0123456789abcdef"
SAMPLING = SamplingParams(temperature=1.0, max_tokens=4)
CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=0))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    """An endpoint with the key it made itself (no key configured: the default)."""
    with InferenceServer(InferenceServerConfig(serve_http=True), model, tokenizer) as srv:
        yield srv


def _base(server) -> str:
    return server.url.removesuffix("/v1")


def _error_of(response: httpx.Response) -> dict:
    """The OpenAI-format error of a 401 (checking the format on the way)."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    return error


# ------------------------------------------------------------------------------- the key is required


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/no/such/route"),
])
def test_every_route_but_health_needs_the_key(server, method, path):
    body = CHAT if path.endswith("chat/completions") else {"model": SERVED, "prompt": "a", "max_tokens": 2}
    kwargs = {"json": body} if method == "POST" else {}
    with httpx.Client(base_url=_base(server), timeout=60) as http:
        missing = _error_of(http.request(method, path, **kwargs))
        assert missing["message"].startswith("missing API key") and "Authorization: Bearer" in missing["message"]
        key = server.api_key
        for header in (f"Bearer {key}x", f"Bearer {key[:-1]}", "Bearer", f"Basic {key}", key, f"Bearer {KEY}"):
            wrong = _error_of(http.request(method, path, headers={"Authorization": header}, **kwargs))
            assert wrong["message"].startswith("incorrect API key") and key[8:16] not in wrong["message"]
        health = http.get("/health")  # the liveness probe stays open: it tells nothing but the model name
        assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_openai_client_gets_an_authentication_error(server):
    def refused(key):
        client = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            client.chat.completions.create(**CHAT)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            client.models.list()

    refused("none")  # what clients of the endpoint sent before it had a key
    refused(server.api_key + "x")


def test_the_right_key_serves_the_same_tokens_as_generate(server, tokenizer):
    client = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["marinrl-policy"]
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=8, temperature=0.7, logprobs=True,
                                       seed=3)
    prompt = chat_prompt_tokens(tokenizer, msgs)
    (ref,) = server.generate([prompt, prompt], 1, SamplingParams(temperature=0.7, max_tokens=8), seed=3)[0]
    (choice,) = r.choices
    assert r.prompt_token_ids == prompt and choice.token_ids == ref.tokens.tolist()
    # float32 logprobs of the same tokens from a device call of another batch shape: a few ulps of values ~1..10
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], ref.logprobs, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ in-process agents


class _Context:
    """An inference context reaching `server`'s endpoint with the key given here."""

    def __init__(self, server, api_key):
        self.server, self.url, self.api_key = server, server.url, api_key

    @property
    def tokenizer(self):
        return self.server.tokenizer

    def generate(self, prompts, n, sampling, seed):
        return self.server.generate(prompts, n, sampling, seed)


def _sample(env, ctx):
    return safe_sample(env, ctx, lesson_id="l", n_examples=2, n_generations=2, sampling=SAMPLING,
                       rng=np.random.default_rng(0), mode="train",
                       metadata=RolloutMetadata(worker_id="test", weight_step=0))


def test_the_openai_agent_env_passes_the_key_itself(server):
    env = OpenAIAgentEnv(EchoChatAgent(alphabet_size=4), max_concurrency=4)
    groups, m = _sample(env, server)  # the agent never sees a key: the env takes the server's
    assert m["l/env_failures"] == 0 and m["l/episodes_ok"] == 4 and m["l/requests_failed"] == 0
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    # the key is really checked on the env's traffic: a wrong one fails every episode, unretried
    groups, m = _sample(env, _Context(server, "wrong-key"))
    assert groups == [] and m["l/episodes_failed"] == 4 and m["l/episodes_ok"] == 0
    assert m["l/requests"] == 4 and m["l/requests_retried"] == 0


def test_a_job_rollout_worker_path_serves_openai_agent_lessons_behind_a_key(model, tokenizer):
    """What RolloutActor does: the job's default inference config (no HTTP, no key), HTTP turned on for
    an `openai_agent` lesson, the server as the manager's context. The env's episodes get through with
    the generated key; a request without it does not."""
    lesson = EnvConfig(name="openai_agent", args={"agent": "marinrl.envs.openai_agents:EchoChatAgent",
                                                  "agent_args": {"alphabet_size": 4}, "max_concurrency": 4})
    config = with_endpoint_if_needed(RLJobConfig().inference, [lesson])
    assert config.serve_http
    with InferenceServer(config, model, tokenizer) as srv:
        _error_of(httpx.post(f"{srv.url}/chat/completions", json=CHAT, timeout=60))
        assert config.api_key is None and len(srv.api_key) >= 32  # generated for this start
        manager = RolloutManager(srv, {"echo": LessonRuntime(functools.partial(make_env, lesson), SAMPLING)})
        batch, m = manager.sample_batch("echo", 2, 2, "train", np.random.default_rng(0), weight_step=0,
                                        worker_id="rollout-0")
    assert m["echo/env_failures"] == 0 and m["echo/episodes_ok"] == 4 and m["echo/requests"] == 4
    assert len(batch.groups) == 2 and all(len(g) == 2 for g in batch.groups)
    for r in batch.rollouts:  # trainable: sampled tokens with their logprobs, all in the loss
        assert r.loss_mask.all() and r.response_tokens.size == r.response_logprobs.size >= 1
        assert np.all(np.isfinite(r.response_logprobs)) and np.all(r.response_logprobs <= 0)


def test_a_server_without_a_configured_key_makes_one_per_start_and_never_logs_it(model, tokenizer, caplog):
    caplog.set_level(logging.DEBUG)
    keys = []
    for _ in range(2):
        with InferenceServer(InferenceServerConfig(serve_http=True), model, tokenizer) as srv:
            key = srv.api_key
            assert len(key) >= 32 and key not in keys
            keys.append(key)
            with httpx.Client(base_url=_base(srv), timeout=60) as http:
                assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
                for other in keys[:-1]:  # an earlier start's key opens nothing now
                    _error_of(http.get("/v1/models", headers={"Authorization": f"Bearer {other}"}))
                _error_of(http.get("/v1/models"))
    configured = InferenceServerConfig(api_key=KEY)
    assert KEY not in repr(configured) and KEY not in str(configured)
    assert not any(k in caplog.text for k in [*keys, KEY])


# ---------------------------------------------------------------------------- non-loopback hosts


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.org"])
def test_a_non_loopback_host_without_a_key_is_refused_at_config_time(host):
    with pytest.raises(ValueError, match=r"inference\.host is .* but inference\.api_key is not set"):
        InferenceServerConfig(host=host)
    with pytest.raises(ValueError, match=r"inference\.host .* inference\.api_key"):
        InferenceServerConfig(host=host, serve_http=False)  # the host means nothing else: refused all the same
    assert InferenceServerConfig(host=host, api_key=KEY).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts_need_no_configured_key(host):
    assert InferenceServerConfig(host=host).api_key is None


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "caf\u00e9"])
def test_a_malformed_key_is_refused_without_showing_it(bad):
    with pytest.raises(ValueError, match=r"inference\.api_key must be a non-empty string") as info:
        InferenceServerConfig(api_key=bad)
    assert not bad or bad not in str(info.value)


def test_a_job_config_on_0_0_0_0_without_a_key_fails_when_parsed(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("run_id: auth\ninference: {host: 0.0.0.0, serve_http: true}\n")
    with pytest.raises(Exception) as info:
        draccus.parse(RLJobConfig, config_path=str(path), args=[])
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("inference.host is '0.0.0.0'" in m and "inference.api_key is not set" in m for m in chain), chain
    job = draccus.parse(RLJobConfig, config_path=str(path), args=["--inference.api_key", KEY])
    assert job.inference.api_key == KEY and job.inference.host == "0.0.0.0"


def test_overriding_another_inference_field_does_not_start_the_endpoint(tmp_path):
    """draccus rebuilds InferenceServerConfig from its class defaults when a YAML or a flag sets any of
    its fields: the class default itself must be 'no endpoint', or `--inference.api_key K` alone would
    open a port the job never asked for."""
    path = tmp_path / "job.yaml"
    path.write_text("run_id: auth\ninference: {backend: scan}\n")
    assert not draccus.parse(RLJobConfig, config_path=str(path), args=[]).inference.serve_http
    assert not draccus.parse(RLJobConfig, args=["--inference.api_key", KEY]).inference.serve_http
    assert not RLJobConfig().inference.serve_http


def test_a_server_on_all_interfaces_serves_with_its_configured_key_only(model, tokenizer):
    with InferenceServer(InferenceServerConfig(host="0.0.0.0", api_key=KEY, serve_http=True), model, tokenizer) as srv:
        assert srv.url.startswith("http://0.0.0.0:") and srv.api_key == KEY
        with httpx.Client(base_url=f"http://127.0.0.1:{httpx.URL(srv.url).port}", timeout=60) as http:
            _error_of(http.get("/v1/models"))
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_server_on_ipv6_loopback(model, tokenizer):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with InferenceServer(InferenceServerConfig(host="::1", serve_http=True), model, tokenizer) as srv:
        assert srv.url.startswith("http://[::1]:")
        with httpx.Client(base_url=_base(srv), timeout=60) as http:
            _error_of(http.get("/v1/models"))
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {srv.api_key}"}).status_code == 200
