"""The `verifiers` environment against the real verifiers 0.4 package in its own virtualenv (`.venv-verifiers`,
which `make test` builds; the `verifiers_python` fixture): two environments written against verifiers' public API
in tests/verifiers_envs/ and installed into that virtualenv as a package (`vf_letter`, single-turn; `vf_calc`, a
multi-turn tool environment), each loaded by its id; EnvServers started and restarted by the environment; the
episodes sampled by our inference server's token endpoint; and a short job end to end.

Starting verifiers costs seconds (its import), so one environment of each kind serves the whole module."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from levanter.models.llama import LlamaConfig

from marinrl.config.curriculum import CurriculumConfig, LessonConfig
from marinrl.config.errors import ConfigError
from marinrl.envs import EnvConfig, safe_sample
from marinrl.envs.base import make_env
from marinrl.inference.context import SamplingParams
from marinrl.inference.server import InferenceServer, InferenceServerConfig
from marinrl.models.policy_model import ModelConfig, build_model
from marinrl.models.tokenizers import byte_tokenizer
from marinrl.types import RolloutMetadata

SUBPROCESS = {"agent": {"runtime": {"type": "subprocess"}}}
"""The harnesses of tests/verifiers_envs run in the EnvServer's process: no container or cloud box."""


BYTE_RENDERER = {"name": "custom", "import_path": "vf_byte_renderer.ByteChatRenderer"}
"""The default renderer with a bridge (tests/verifiers_envs/vf_byte_renderer.py): turn k+1's prompt extends the tokens
sampled so far, as a model-specific renderer's does; without one, verifiers re-renders the conversation from text, in
which a random model's bytes do not survive, and starts a new branch."""


def _args(python, env_id, **kw):
    return {"env_id": env_id, "python": python, "env_args": SUBPROCESS, "episode_timeout": 120.0, **kw}


@pytest.fixture(scope="module")
def server():
    arch = LlamaConfig(seq_len=128, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2,
                       gradient_checkpointing=False)
    with InferenceServer(InferenceServerConfig(serve_http=True), build_model(ModelConfig(model=arch, vocab_size=512)),
                         byte_tokenizer(512)) as s:
        yield s


@pytest.fixture(scope="module")
def kill_file(tmp_path_factory):
    """While this file exists, the next vf_calc episode deletes it and ends its EnvServer's process (os._exit)."""
    return tmp_path_factory.mktemp("vf") / "kill"


@pytest.fixture(scope="module")
def calc_env(verifiers_python, kill_file):
    os.environ["VF_CALC_KILL_FILE"] = str(kill_file)  # the EnvServer, started at the first sample, inherits it
    args = _args(verifiers_python, "vf_calc", max_concurrency=8, renderer=BYTE_RENDERER)
    env = make_env(EnvConfig("verifiers", args))
    yield env
    env.close()
    os.environ.pop("VF_CALC_KILL_FILE", None)


def _sample(env, server, n_examples=2, n_generations=4, max_tokens=2):
    return safe_sample(env, server, lesson_id="calc", n_examples=n_examples, n_generations=n_generations,
                       sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens), rng=np.random.default_rng(0),
                       mode="train", metadata=RolloutMetadata(worker_id="test", weight_step=0))


@pytest.mark.parametrize("args, match", [
    ({"python": sys.executable}, "env_id"),
    ({"env_id": "x"}, "give python"),
    ({"env_id": "x", "server_address": "tcp://127.0.0.1:1"}, "give python too"),
    ({"env_id": "x", "python": sys.executable, "server_address": "http://x"}, "tcp://host:port"),
    ({"env_id": "x", "python": "/nonexistent/bin/python"}, "/nonexistent/bin/python is not an executable file"),
    ({"env_id": "x", "python": sys.executable, "max_concurrency": 0}, "max_concurrency"),
    ({"env_id": "x", "python": sys.executable, "bogus": 1}, "^verifiers: unknown setting bogus; the settings are "),
])
def test_bad_settings_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        make_env(EnvConfig("verifiers", args))


def test_an_interpreter_without_verifiers_or_an_unknown_id_is_refused_before_a_job(verifiers_python):
    from marinrl.job.preflight import check_environments

    def lesson(args):
        return CurriculumConfig(lessons=(LessonConfig("vf", EnvConfig("verifiers", args)),))

    with pytest.raises(ConfigError, match=r"lessons\[vf\]\.env\.args: verifiers environment 'vf_letter' does not "
                                          r"load with .*: verifiers is not installed there"):
        check_environments(lesson(_args(sys.executable, "vf_letter")))  # marinrl's own venv: no verifiers
    with pytest.raises(ConfigError, match=r"verifiers environment 'no_such_env' does not load with .*"
                                          r"taskset 'no_such_env' not found"):
        check_environments(lesson(_args(verifiers_python, "no_such_env")))


def _script(tmp_path, name: str, body: str) -> str:
    """An executable shell script named as the lesson's `python`."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_python_that_exits_at_once_is_refused_with_what_it_printed_or_that_it_printed_nothing(tmp_path):
    silent = _script(tmp_path, "silent", "exit 1")
    with pytest.raises(ValueError) as caught:
        make_env(EnvConfig("verifiers", {"env_id": "vf_letter", "python": silent})).check_reachable()
    assert str(caught.value) == (f"verifiers environment 'vf_letter': {silent} could not run the bridge (exit 1): it "
                                 "printed nothing: is it a Python 3.11+ interpreter of a virtualenv with verifiers? "
                                 f"`{silent} -c 'import verifiers'` should run")
    loud = _script(tmp_path, "loud", "echo 'this is not python' >&2; exit 3")
    with pytest.raises(ValueError) as caught:
        make_env(EnvConfig("verifiers", {"env_id": "vf_letter", "python": loud})).check_reachable()
    assert str(caught.value) == f"verifiers environment 'vf_letter': {loud} could not run the bridge (exit 3): this " \
                                "is not python"


def test_a_python_that_hangs_is_shown_waiting_within_seconds_then_refused(tmp_path, capfd):
    """The check before a job prints what it waits for once the wait is `WAIT_NOTICE_S` (at most 30 s) old; at its
    limit it kills the process and the children holding its pipes, and names the hang."""
    from marinrl.envs.verifiers_process import WAIT_NOTICE_S

    hung = _script(tmp_path, "hung", "echo importing >&2; sleep 600")  # sleep: a child of the shell
    env = make_env(EnvConfig("verifiers", {"env_id": "vf_letter", "python": hung}))
    limit = WAIT_NOTICE_S + 1.0
    with pytest.raises(ValueError) as caught:
        env.check_reachable(timeout_s=limit)
    assert str(caught.value) == (f"verifiers environment 'vf_letter': {hung} did not load it within {limit:g} s (it "
                                 f"printed: importing); check that `{hung} -c 'import verifiers'` returns (a wrapper "
                                 "waiting for input? a slow network filesystem?)")
    notices = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[marinrl] waiting for")]
    assert WAIT_NOTICE_S <= 30 and len(notices) == 1, notices
    assert notices[0].startswith(f"[marinrl] waiting for {hung} to load the verifiers environment 'vf_letter': no "
                                 f"answer for ") and notices[0].endswith(f"s (up to {limit:g} s)")


def test_an_episode_runs_again_only_while_it_has_retries_left(verifiers_python, server, tmp_path, monkeypatch):
    """`max_retries: 0`: the episode whose EnvServer died under it is counted failed, not run again; the call's
    other episode runs on the restarted server."""
    kill = tmp_path / "kill"
    monkeypatch.setenv("VF_CALC_KILL_FILE", str(kill))  # the EnvServer started at the first sample inherits it
    env = make_env(EnvConfig("verifiers", _args(verifiers_python, "vf_calc", max_concurrency=1, max_retries=0,
                                                renderer=BYTE_RENDERER)))
    try:
        kill.touch()  # the first episode ends its server; the second runs after the restart
        groups, metrics = _sample(env, server, n_examples=1, n_generations=2)
    finally:
        env.close()
    assert not kill.exists() and metrics["calc/env_failures"] == 0, metrics
    assert metrics["calc/server_restarts"] == 1 and metrics["calc/episodes_retried"] == 0, metrics
    assert metrics["calc/episodes_failed"] == 1 and metrics["calc/episodes_ok"] == 1 and len(groups) == 1, metrics


def test_an_episode_past_its_timeout_is_counted_timed_out_not_failed(verifiers_python, server):
    env = make_env(EnvConfig("verifiers", _args(verifiers_python, "vf_letter", episode_timeout=0.01)))
    try:  # no episode answers within 10 ms (each is a request to the EnvServer and a generate call of ours)
        with pytest.raises(RuntimeError, match=r"^verifiers environment 'vf_letter': no episode finished \(2 tried: 0 "
                                               r"failed, 2 timed out\); last error: timeout$"):
            env.sample(server, 1, 2, SamplingParams(temperature=1.0, max_tokens=2), np.random.default_rng(0), "train")
    finally:
        env.close()


def test_a_multi_turn_tool_episode_trains_the_model_turns_and_masks_the_tool(calc_env, server):
    groups, metrics = _sample(calc_env, server)
    assert metrics["calc/env_failures"] == 0 and metrics["calc/episodes_ok"] == 8
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    tok = byte_tokenizer(512)
    for group in groups:
        for r in group.rollouts:
            prompt = tok.decode(r.prompt_tokens.tolist())
            assert prompt.startswith("<|bos|><|user|>") and prompt.endswith("=<|eos|><|assistant|>")  # `3+1=`
            assert r.loss_mask[0] and r.loss_mask[-1]  # the model's first and last tokens
            assert np.all(r.response_logprobs[~r.loss_mask] == 0) and np.all(r.response_logprobs[r.loss_mask] <= 0)
            assert r.token_rewards[-1] == r.episode_reward
    for r in (r for g in groups for r in g.rollouts):  # the calculator's answer between the two turns: masked
        between = tok.decode(r.response_tokens[~r.loss_mask].tolist())
        a, b = tok.decode(r.prompt_tokens.tolist()).split("<|user|>")[1].split("=")[0].split("+")  # `3+1=`
        assert between.endswith(f"<|user|>={int(a) + int(b)}<|eos|><|assistant|>") and not r.loss_mask.all()
        assert r.loss_mask.sum() <= 4  # two turns of at most 2 tokens: one sequence per episode
    assert {"calc/reward/correct_mean", "calc/reward/called_mean", "calc/metric/turns_mean"} <= set(metrics)
    assert metrics["calc/metric/turns_mean"] == 2
    rewards = np.concatenate([g.rewards for g in groups])
    assert np.all((rewards >= 0) & (rewards <= 1.2))


def test_an_env_server_that_dies_is_restarted_and_its_episodes_run_again(calc_env, server, kill_file):
    _sample(calc_env, server, n_examples=1, n_generations=1)  # started
    kill_file.touch()  # the next episode kills its server while the others of its call are in flight
    groups, metrics = _sample(calc_env, server, n_examples=2, n_generations=2)
    assert not kill_file.exists()
    assert metrics["calc/server_restarts"] == 1 and metrics["calc/episodes_retried"] >= 1
    assert metrics["calc/env_failures"] == 0 and metrics["calc/episodes_ok"] == 4 and len(groups) == 2


def test_episodes_run_on_a_running_env_server_by_address(verifiers_python, server, tmp_path):
    """A user's EnvServer (verifiers' own `serve_env`, here through the bridge's `serve`), holding our endpoint's key
    in `MARINRL_API_KEY`, samples; once it is gone, the check before a job names its address."""
    import json
    import subprocess

    from marinrl.envs.verifiers_env import BRIDGE, _free_port

    address = f"tcp://127.0.0.1:{_free_port()}"
    config = json.dumps({"env": {"taskset": {"id": "vf_letter"}, **SUBPROCESS}, "bind": address})
    proc = subprocess.Popen([verifiers_python, "-P", str(BRIDGE), "serve", config], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "MARINRL_API_KEY": server.api_key})
    env = make_env(EnvConfig("verifiers", _args(verifiers_python, "vf_letter", server_address=address)))
    try:  # sampled while the server still starts: the task client waits for its health answer
        groups, metrics = _sample(env, server, n_examples=1, n_generations=2)
        assert proc.stdout.readline().decode().strip() == f"address {address}"
        assert metrics["calc/episodes_ok"] == 2 and len(groups) == 1 and env._server is None  # none of its own
    finally:
        env.close()
        proc.stdin.close()  # the bridge's server ends with its stdin
        proc.wait(timeout=60)
    with pytest.raises(ValueError, match=f"no EnvServer answers at {address}"):
        env.check_reachable()


@pytest.mark.timeout(1200)
def test_a_short_job_trains_on_a_single_turn_and_a_multi_turn_verifiers_environment(tmp_path, ray_session,
                                                                                      verifiers_python):
    from test_job import _run

    letters = EnvConfig("verifiers", _args(verifiers_python, "vf_letter"))
    calc = EnvConfig("verifiers", _args(verifiers_python, "vf_calc", renderer=BYTE_RENDERER))
    lessons = (LessonConfig("letters", letters, max_tokens=2, graduate_at=None),
               LessonConfig("calc", calc, max_tokens=2, graduate_at=None))
    cfg, result = _run(tmp_path, ray_session, curriculum=CurriculumConfig(lessons=lessons), num_train_steps=2,
                       eval_every=2)
    assert result.train["final_step"] == 2 and all(np.isfinite(h["loss"]) for h in result.train["history"])
    (rollouts,) = result.rollouts
    assert rollouts["sample_failures"] == 0
    evals = [e["metrics"] for e in rollouts["evals"] if e["kind"] == "eval"]
    assert np.isfinite(evals[-1]["eval/letters/reward_mean"]) and np.isfinite(evals[-1]["eval/calc/reward_mean"])
    assert evals[-1]["eval/calc/metric/turns_mean"] == 2
