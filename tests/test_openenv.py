"""The openenv environment against a real OpenEnv server process on localhost (tests/openenv_server.py,
built with openenv-core's server API): multi-turn episodes over its WebSocket protocol, rewards from the
server, masks, the concurrency bound, retries and timeouts, and a short job end to end."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.envs import EnvConfig, safe_sample
from marinrl.envs.base import make_env
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer, InferenceServerConfig
from marinrl.models.policy_model import ModelConfig, build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutMetadata

pytest.importorskip("openenv.core")  # the `openenv` extra (in `dev`: CI has it)

SERVER = pathlib.Path(__file__).with_name("openenv_server.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def openenv_url():
    """A fresh server process per test (its /stats start at zero); stopped at the end."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if _get(f"{url}/health")["status"] == "healthy":
                break
        except OSError:
            pass
        assert proc.poll() is None, "the OpenEnv server exited"
        assert time.monotonic() < deadline, "the OpenEnv server did not come up in 120 s"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    arch = LlamaConfig(seq_len=128, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
                       gradient_checkpointing=False)
    with InferenceServer(InferenceServerConfig(serve_http=False), build_model(ModelConfig(model=arch, vocab_size=512)),
                         byte_tokenizer(512)) as s:
        yield s


def _sample(env, server, n_examples=4, n_generations=4):
    return safe_sample(env, server, lesson_id="letters", n_examples=n_examples, n_generations=n_generations,
                       sampling=SamplingParams(temperature=1.0, max_tokens=1), rng=np.random.default_rng(0),
                       mode="train", metadata=RolloutMetadata(worker_id="test", weight_step=0))


def _args(url, **kw):
    return {"url": url, "action_field": "message", "observation_field": "prompt", "chat": False, **kw}


def test_episodes_follow_the_server_turn_by_turn_and_bounded(openenv_url, server):
    env = make_env(EnvConfig("openenv", _args(openenv_url, max_concurrency=3)))
    groups, metrics = _sample(env, server)
    assert metrics["letters/env_failures"] == 0 and metrics["letters/episodes"] == 16
    assert metrics["letters/episodes_failed"] == 0 and len(groups) == 4, metrics
    tok = server.tokenizer
    for g in groups:
        assert len(g) == 4 and g.group_id.startswith("openenv:seed")
        for r in g.rollouts:
            letter = tok.decode(list(r.prompt_tokens[1:]))[0]  # the first observation, after BOS: `c>`
            assert tok.decode(list(r.prompt_tokens[1:])) == f"{letter}>"
            mask = np.asarray(r.loss_mask)
            turns = [tok.decode([int(t)]) for t, m in zip(r.response_tokens, mask) if m]
            between = tok.decode([int(t) for t, m in zip(r.response_tokens, mask) if not m])
            # the server's rule: 1 for repeating the letter (the episode ends), two tries, `no c>` between
            assert r.episode_reward == float(letter in turns)
            assert len(turns) == (1 if turns[0] == letter else 2)
            assert between == ("" if len(turns) == 1 else f"no {letter}>")
            assert np.all(np.asarray(r.response_logprobs)[~mask] == 0.0)
    stats = _get(f"{openenv_url}/stats")
    assert stats["opened"] == 16 and stats["max_open"] <= 3 and stats["open"] == 0  # every session closed


def test_a_server_that_is_not_there_is_retried_then_counted(server):
    env = make_env(EnvConfig("openenv", _args(f"http://127.0.0.1:{_free_port()}", max_retries=2, backoff_initial=0.01,
                                     backoff_max=0.02)))
    groups, metrics = _sample(env, server, n_examples=2, n_generations=2)
    assert groups == [] and metrics["letters/env_failures"] == 0
    assert metrics["letters/episodes_failed"] == 4 and metrics["letters/sessions_retried"] == 8


def test_a_step_past_its_timeout_drops_its_episode(openenv_url, server):
    env = make_env(EnvConfig("openenv", _args(openenv_url, action_args={"delay": 3.0}, request_timeout=0.5)))
    groups, metrics = _sample(env, server, n_examples=2, n_generations=2)
    assert groups == [] and metrics["letters/episodes_failed"] == 4 and metrics["letters/env_failures"] == 0


def test_a_wrong_observation_field_fails_the_call_naming_it(openenv_url, server):
    env = make_env(EnvConfig("openenv", _args(openenv_url, observation_field="text")))
    groups, metrics = _sample(env, server, n_examples=1, n_generations=2)
    assert groups == [] and metrics["letters/env_failures"] == 1


@pytest.mark.parametrize("args, match", [
    ({"url": "localhost:8000"}, "url must be"),
    ({"url": "http://x", "max_concurrency": 0}, "max_concurrency"),
    ({"url": "http://x", "bogus": 1}, "bad settings"),
])
def test_bad_settings_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        make_env(EnvConfig("openenv", args))


@pytest.mark.timeout(1200)
def test_a_short_job_trains_on_an_openenv_server(openenv_url, tmp_path, ray_session):
    from test_job import _run

    lesson = LessonConfig("letters", EnvConfig("openenv", _args(openenv_url, max_episode_tokens=16)), max_tokens=1,
                          graduate_at=None)
    cfg, result = _run(tmp_path, ray_session, curriculum=CurriculumConfig(lessons=(lesson,)), num_train_steps=3,
                       eval_every=3)
    assert result.train["final_step"] == 3 and all(np.isfinite(h["loss"]) for h in result.train["history"])
    evals = [e["metrics"] for e in result.rollouts[0]["evals"] if e["kind"] == "eval"]
    assert np.isfinite(evals[-1]["eval/letters/reward_mean"])
    assert _get(f"{openenv_url}/stats")["opened"] >= 3 * cfg.groups_per_step * cfg.n_generations
