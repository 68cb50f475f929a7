"""Environments over HTTP: token ids from the OpenAI endpoint (served by the scan sampler), the
`openai_agent` env's rollouts (single calls, stitched and split multi-call episodes), its concurrency
bound, timeouts, retries with backoff through a real failing HTTP proxy, and failure accounting.

One tiny model and one server (HTTP through the scan sampler) for the module; the architecture is
test_inference.py's, so compiled shapes are shared through the persistent cache.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.env import EnvConfig
from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.envs import Grade, Problem, safe_sample
from marinrl.envs.agent_calls import Call, stitch
from marinrl.envs.base import make_env
from marinrl.envs.openai_agents import EchoChatAgent, TwoTurnEchoAgent
from marinrl.envs.openai_env import OpenAIAgentEnv
from marinrl.inference.context import SamplingParams, chat_prompt_tokens
from marinrl.inference.server import InferenceServer
from marinrl.models.policy_model import build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutMetadata

ARCH = LlamaConfig(
    seq_len=128, hidden_dim=64, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
    gradient_checkpointing=False,
)
VOCAB = 512
SERVED = "marinrl-policy"  # the model name the endpoint serves (another is refused)
SAMPLING = SamplingParams(temperature=1.0, max_tokens=4)
META = RolloutMetadata(worker_id="test", weight_step=0)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def server(tokenizer):
    srv = InferenceServer(InferenceServerConfig(serve_http=True),
                          build_model(ModelConfig(model=ARCH, vocab_size=VOCAB, seed=0)), tokenizer)
    with srv:
        yield srv


def _sample(env, ctx, n_examples, n_generations, sampling=SAMPLING, seed=0):
    return safe_sample(env, ctx, lesson_id="l", n_examples=n_examples, n_generations=n_generations,
                       sampling=sampling, rng=np.random.default_rng(seed), mode="train", metadata=META)


# ------------------------------------------------------------------------------------- endpoint


def test_endpoint_token_ids_and_logprobs_equal_the_scan_sampler(server, tokenizer):
    client = openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=8, temperature=0.7, logprobs=True,
                                       seed=3)
    (choice,) = r.choices
    prompt = chat_prompt_tokens(tokenizer, msgs)
    assert r.prompt_token_ids == prompt
    # prompt 0 of a 2-prompt call has the same key, (3, 0); 2 prompts: the shape compiled below too
    (ref,) = server.generate([prompt, prompt], 1, SamplingParams(temperature=0.7, max_tokens=8), seed=3)[0]
    assert choice.token_ids == ref.tokens.tolist()
    # other batch shape
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], ref.logprobs, atol=1e-5)
    assert choice.finish_reason == ref.finish_reason
    # completions: prompt i of a request is sampled with (seed, i), as `generate` samples prompt i
    prompts = [[97, 98], [99, 100, 101]]
    c = client.completions.create(model=SERVED, prompt=prompts, max_tokens=5, seed=9, logprobs=1)
    refs = server.generate(prompts, 1, SamplingParams(max_tokens=5), seed=9)
    for k, ch in enumerate(c.choices):
        (g,) = refs[k]
        assert ch.prompt_token_ids == prompts[k] and ch.token_ids == g.tokens.tolist()
        np.testing.assert_allclose(ch.logprobs.token_logprobs, g.logprobs, atol=1e-5)


# ------------------------------------------------------------------------------------ stitching


def test_stitch_rule():
    a = Call((1, 2), (3, 4), (-0.1, -0.2), "stop", 1.0)
    b = Call((1, 2, 3, 4, 9, 9), (5,), (-0.3,), "length", 1.0)  # extends: 9, 9 are template tokens
    c = Call((1, 2, 7), (8,), (-0.4,), "stop", 1.0)  # history re-rendered differently: a new segment
    (one,) = stitch([a, b])
    assert one.prompt == [1, 2] and one.tokens == [3, 4, 9, 9, 5] and one.loss_mask == [1, 1, 0, 0, 1]
    assert one.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3] and one.finish_reason == "length"
    first, second = stitch([a, b, c])
    assert first == one and second.prompt == [1, 2, 7] and second.tokens == [8] and second.loss_mask == [1]


# ---------------------------------------------------------------------------------------- env


class RecordingEcho(EchoChatAgent):
    """The echo agent, keeping what the endpoint told it (to compare with the rollouts)."""

    def __init__(self):
        super().__init__(alphabet_size=4)
        self.seen: dict[tuple, list] = {}

    async def run_episode(self, client, model, problem):
        reply = await client.chat.completions.create(model=model,
                                                     messages=[{"role": "user", "content": problem.prompt}])
        ch = reply.choices[0]
        self.seen.setdefault(tuple(ch.token_ids), []).append([c.logprob for c in ch.logprobs.content])
        return Grade(reward=len(ch.token_ids) / 10, indicators={"long": float(len(ch.token_ids) == 4)})


def test_single_call_episodes_become_one_group_per_problem(server, tokenizer):
    agent = RecordingEcho()
    groups, m = _sample(OpenAIAgentEnv(agent, max_concurrency=8), server, 3, 4)
    assert m["l/env_failures"] == 0 and m["l/malformed_groups"] == 0
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    assert m["l/episodes_ok"] == 12 and m["l/requests"] == 12 and m["l/long_frac"] > 0
    for g in groups:
        assert len({r.prompt_tokens.tobytes() for r in g.rollouts}) == 1
        for r in g.rollouts:
            text = tokenizer.decode(r.prompt_tokens.tolist())
            assert text.startswith("<|bos|><|user|>") and text.endswith("=<|eos|><|assistant|>")
            assert r.loss_mask.all() and r.temperature == 1.0 and r.metadata == META
            assert r.episode_reward == r.token_rewards[-1] == len(r.response_tokens) / 10
            np.testing.assert_allclose(r.response_logprobs, agent.seen[tuple(r.response_tokens.tolist())][0], atol=1e-6)
    # samples differ across the episodes of a problem (each gets its own seed)
    assert len({r.response_tokens.tobytes() for g in groups for r in g.rollouts}) >= 10


def test_two_call_episodes_are_stitched_or_split(server, tokenizer):
    """A random model's first answer (one token) survives the text round trip of the chat template iff
    it is ASCII or EOS: then the episode is one sequence with the template tokens masked; otherwise the
    second call starts a new segment (group `#1`)."""
    env = make_env(EnvConfig(name="openai_agent", args={"agent": "marinrl.envs.openai_agents:TwoTurnEchoAgent",
                                                        "agent_args": {"alphabet_size": 4}, "max_concurrency": 8}))
    sampling = SamplingParams(temperature=1.0, max_tokens=1)
    groups, m = _sample(env, server, 4, 8, sampling)
    assert m["l/malformed_groups"] == 0 and m["l/episodes_ok"] == 32 and m["l/requests"] == 64
    eos = tokenizer.eos_token_id
    # <|user|>again<|eos|><|assistant|>
    again = chat_prompt_tokens(tokenizer, [{"role": "user", "content": "again"}])[1:]
    stitched = split_first = split_second = 0
    for g in groups:
        for r in g.rollouts:
            t1 = int(r.response_tokens[0])
            if "#1" in g.group_id:
                split_second += 1
                assert len(r.response_tokens) == 1 and r.loss_mask.all()
            elif len(r.response_tokens) == 1:
                split_first += 1
                assert not (t1 < 128 or t1 == eos)
            else:
                stitched += 1
                between = again if t1 == eos else [eos] + again
                assert t1 < 128 or t1 == eos
                assert r.response_tokens[1:-1].tolist() == between
                assert r.loss_mask.tolist() == [True] + [False] * len(between) + [True]
                assert np.all(r.response_logprobs[1:-1] == 0) and np.all(r.response_logprobs[[0, -1]] < 0)
    assert stitched > 0 and split_first > 0 and split_first == split_second == m["l/episodes_split"]
    # on_mismatch="fail": the split episodes are dropped and counted instead
    strict = OpenAIAgentEnv(TwoTurnEchoAgent(alphabet_size=4), max_concurrency=8, on_mismatch="fail")
    groups, m = _sample(strict, server, 4, 8, sampling)
    assert m["l/episodes_unusable"] == 32 - m["l/episodes_ok"] > 0 and m["l/episodes_split"] == 0
    assert all("#1" not in g.group_id and len(r.response_tokens) > 1 for g in groups for r in g.rollouts)


class CountingEcho(EchoChatAgent):
    """Counts episodes and asyncio tasks alive at once."""

    def __init__(self):
        super().__init__(alphabet_size=4)
        self.in_flight = self.max_in_flight = self.max_tasks = 0

    async def run_episode(self, client, model, problem):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.max_tasks = max(self.max_tasks, len(asyncio.all_tasks()))
        try:
            await asyncio.sleep(0.01)
            return await super().run_episode(client, model, problem)
        finally:
            self.in_flight -= 1


def test_concurrency_never_exceeds_the_bound(server):
    agent = CountingEcho()
    groups, m = _sample(OpenAIAgentEnv(agent, max_concurrency=3), server, 5, 4)
    assert m["l/episodes_ok"] == 20 and len(groups) == 5
    assert agent.max_in_flight == 3
    assert agent.max_tasks <= 2 * 3 + 1  # the runner + (episode, its timeout wrapper) per slot, not 20 tasks


class FlakyEcho(EchoChatAgent):
    """Problem `hang` never returns, problem `boom` raises; the others answer."""

    def problems(self, n, rng, mode):
        return [Problem("hang=", "x", "hang"), Problem("boom=", "x", "boom")] + super().problems(n - 2, rng, mode)

    async def run_episode(self, client, model, problem):
        if problem.example_id == "hang":
            await asyncio.sleep(3600)
        if problem.example_id == "boom":
            raise RuntimeError("agent bug")
        return await super().run_episode(client, model, problem)


def test_a_hanging_or_failing_episode_is_cut_and_counted(server):
    env = OpenAIAgentEnv(FlakyEcho(alphabet_size=4), max_concurrency=8, episode_timeout=1.0)
    started = time.perf_counter()
    groups, m = _sample(env, server, 4, 2)
    assert time.perf_counter() - started < 10
    assert m["l/env_failures"] == 0
    assert m["l/episodes_timed_out"] == 2 and m["l/episodes_failed"] == 2 and m["l/episodes_ok"] == 4
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    assert not any(g.group_id.split(":")[1] in ("hang", "boom") for g in groups)


# -------------------------------------------------------------------------------- retries over HTTP


class FailingProxy:
    """A real HTTP server in front of the endpoint that answers the first `fail_first` POSTs (or all,
    with -1) with 503, and forwards the others. Records when each POST arrived."""

    def __init__(self, target: str, fail_first: int):
        self.target, self.fail_first, self.arrivals = target.removesuffix("/v1"), fail_first, []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.arrivals.append(time.perf_counter())
                if proxy.fail_first < 0 or len(proxy.arrivals) <= proxy.fail_first:
                    self._reply(503, json.dumps({"error": {"message": "overloaded", "type": "server_error"}}).encode())
                    return
                req = urllib.request.Request(proxy.target + self.path, data=body,
                                             headers={"Content-Type": "application/json",
                                                      "Authorization": self.headers["Authorization"]})
                try:
                    with urllib.request.urlopen(req) as resp:
                        self._reply(resp.status, resp.read())
                except urllib.error.HTTPError as e:
                    self._reply(e.code, e.read())

            def _reply(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


class Via:
    """An inference context whose endpoint is reached through `url` (the proxy), with the server's key."""

    def __init__(self, server, url):
        self.server, self.url, self.api_key = server, url, server.api_key

    @property
    def tokenizer(self):
        return self.server.tokenizer

    def generate(self, prompts, n, sampling, seed):
        return self.server.generate(prompts, n, sampling, seed)


def test_transient_503s_are_retried_with_exponential_backoff(server):
    env = OpenAIAgentEnv(EchoChatAgent(alphabet_size=4), max_concurrency=1, max_retries=3, backoff_initial=0.05)
    with FailingProxy(server.url, fail_first=3) as proxy:
        groups, m = _sample(env, Via(server, proxy.url), 2, 2)
    assert m["l/episodes_ok"] == 4 and len(groups) == 2
    assert m["l/requests"] == 4 and m["l/requests_retried"] == 3 and m["l/requests_failed"] == 0
    gaps = np.diff(proxy.arrivals[:4])  # the first request: three 503s, then served
    for k, gap in enumerate(gaps):
        assert gap >= 0.05 * 2**k * 0.5, gaps  # backoff doubles, jitter takes at most half


def test_a_persistent_failure_is_counted_not_raised(server):
    env = OpenAIAgentEnv(EchoChatAgent(alphabet_size=4), max_concurrency=4, max_retries=2, backoff_initial=0.01)
    with FailingProxy(server.url, fail_first=-1) as proxy:
        groups, m = _sample(env, Via(server, proxy.url), 2, 2)
    assert groups == [] and m["l/env_failures"] == 0
    assert m["l/episodes_failed"] == 4 and m["l/requests_failed"] == 4 and m["l/requests_retried"] == 8
    assert len(proxy.arrivals) == 12


# ------------------------------------------------------------------------------------ edges


def test_sample_works_inside_a_running_event_loop(server):
    env = OpenAIAgentEnv(EchoChatAgent(alphabet_size=4), max_concurrency=4)

    async def caller():
        return env.sample(server, 2, 2, SAMPLING, np.random.default_rng(0), "eval")

    groups, m = asyncio.run(caller())
    assert len(groups) == 2 and m["episodes_ok"] == 4


def test_a_context_without_endpoint_and_bad_settings_are_clear_errors(server):
    env = OpenAIAgentEnv(EchoChatAgent())

    class NoHTTP:
        tokenizer = server.tokenizer

    with pytest.raises(ValueError, match="serve_http"):
        env.sample(NoHTTP(), 1, 1, SAMPLING, np.random.default_rng(0), "train")
    with pytest.raises(ValueError, match="max_concurrency"):
        OpenAIAgentEnv(EchoChatAgent(), max_concurrency=0)
    with pytest.raises(ValueError, match="unknown setting"):
        OpenAIAgentEnv(EchoChatAgent(), concurrency=4)
    with pytest.raises(ValueError, match="no attribute"):
        make_env(EnvConfig(name="openai_agent", args={"agent": "marinrl.envs.openai_agents:Nope"}))

    class SyncAgent:
        def problems(self, n, rng, mode):
            return []

        def run_episode(self, client, model, problem):
            return 0.0

    with pytest.raises(TypeError, match="async def"):
        OpenAIAgentEnv(SyncAgent())


def test_the_http_example_in_docs_environments_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "# example: http\n" in b]
    assert len(blocks) == 1, "docs/environments.md must hold one block marked '# example: http'"
    namespace: dict = {"__name__": "docs_example_http"}
    exec(compile(blocks[0], "docs/environments.md", "exec"), namespace)
    m = namespace["metrics"]
    assert m["capital/env_failures"] == 0 and m["capital/episodes_ok"] == 8 and len(namespace["groups"]) >= 1
