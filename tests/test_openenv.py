"""The openenv environment against a real OpenEnv server process on localhost (tests/openenv_server.py,
built with openenv-core's server API): multi-turn episodes over its WebSocket protocol, rewards from the
server, masks, the concurrency bound, retries and timeouts, and a short job end to end."""

from __future__ import annotations

import http.server
import json
import pathlib
import re
import socket
import subprocess
import sys
import threading
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


def test_a_server_that_is_not_there_is_retried_then_fails_the_call_with_its_cause(server):
    """Every session refused: the call fails with the cause (the job's last line), not "no groups"."""
    from marinrl.logs import ENV_ERRORS

    url = f"http://127.0.0.1:{_free_port()}"
    env = make_env(EnvConfig("openenv", _args(url, max_retries=2, backoff_initial=0.01, backoff_max=0.02)))
    groups, metrics = _sample(env, server, n_examples=2, n_generations=2)
    assert groups == [] and metrics["letters/env_failures"] == 1
    last = ENV_ERRORS.last()
    assert last.startswith(f"ConnectionError: openenv: no session could be opened on {url} (4 tried, 3 tries each): ")
    assert "ConnectionError: Failed to connect" in last


@pytest.fixture
def silent_url():
    """A local TCP server that accepts connections and never answers (issue 33's stalled OpenEnv server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held, done = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    done.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


@pytest.fixture
def not_openenv_url():
    """A real HTTP server that is not OpenEnv: every path, `/ws` included, is 404."""
    class NotFound(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_error(404)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_the_url_is_checked_before_a_job_with_the_cause_in_one_line(silent_url, not_openenv_url):
    from marinrl.config.curriculum import CurriculumConfig
    from marinrl.config.errors import ConfigError
    from marinrl.job.preflight import check_environments

    refused = f"http://127.0.0.1:{_free_port()}"
    for url, cause in [(refused, "Connect call failed"), (not_openenv_url, "HTTP 404"),
                       (silent_url, "no WebSocket handshake within 1 s")]:
        lesson = LessonConfig("letters", EnvConfig("openenv", _args(url, request_timeout=1.0)))
        with pytest.raises(ConfigError) as caught:
            check_environments(CurriculumConfig(lessons=(lesson,)))
        message = str(caught.value)
        where = "RLJobConfig.curriculum.lessons[letters].env.args"
        assert message.startswith(f"{where}: openenv: cannot open a session on url {url}: "), message
        assert cause in message and "\n" not in message, message


def test_a_wait_on_a_server_that_never_answers_is_visible_while_it_lasts(silent_url, server):
    """What the job's driver prints (`RolloutActor.waits`, marinrl/logs.py `WAITS`) names the wait within
    seconds of it starting, long before its 4 s deadline; its end fails the call with the cause."""
    from marinrl.job.terminal import StallNotices
    from marinrl.logs import ENV_ERRORS, WAITS

    env = make_env(EnvConfig("openenv", _args(silent_url, request_timeout=4.0, max_retries=0)))
    got = []
    caller = threading.Thread(target=lambda: got.append((_sample(env, server, 1, 2), ENV_ERRORS.last())))
    caller.start()
    what = f"openenv: opening a session on {silent_url} (up to 1 tries of 4 s)"
    deadline = time.monotonic() + 60
    # Both sessions of the wave are shown as one line; the second may open a moment after the first.
    while not any(line.startswith(f"{what}: no answer for ") and line.endswith("(2 waiting)")
                  for line in WAITS.overdue(0.0)):
        assert caller.is_alive() and time.monotonic() < deadline, WAITS.overdue(0.0)
        time.sleep(0.02)
    (line,) = [w for w in WAITS.overdue(0.0) if w.startswith(what)]
    notices = StallNotices(repeat_s=60.0)
    (printed,) = notices.lines(0, [line], now=100.0)
    assert printed.startswith(f"[marinrl] rollout worker 0 is waiting: {what}: no answer for ")
    assert notices.lines(0, [line], now=130.0) == [] and len(notices.lines(0, [line], now=161.0)) == 1
    caller.join(60)
    ((groups, metrics), last), = got
    assert groups == [] and metrics["letters/env_failures"] == 1
    assert f"no session could be opened on {silent_url}" in last
    assert not [w for w in WAITS.overdue(0.0) if w.startswith(what)]  # a wait that ended is no longer shown


def test_a_step_that_has_not_answered_is_shown_as_a_wait_while_it_lasts(openenv_url, server):
    """A session that opened and then a step the server holds (`delay`): the wait the job's driver prints names the
    step, long before its deadline, and is gone once the step answered."""
    from marinrl.logs import WAITS

    env = make_env(EnvConfig("openenv", _args(openenv_url, action_args={"delay": 3.0}, request_timeout=60.0,
                                              max_turns=1)))
    got = []
    caller = threading.Thread(target=lambda: got.append(_sample(env, server, 1, 1)))
    caller.start()
    what = f"openenv: a step on {openenv_url} (timeout 60 s)"
    deadline = time.monotonic() + 60
    while not any(line.startswith(f"{what}: no answer for ") for line in WAITS.overdue(0.0)):
        assert caller.is_alive() and time.monotonic() < deadline, WAITS.overdue(0.0)
        time.sleep(0.02)
    caller.join(60)
    ((groups, metrics),) = got
    assert metrics["letters/episodes_failed"] == 0 and len(groups) == 1, metrics
    assert not [w for w in WAITS.overdue(0.0) if w.startswith(what)]


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
    ({"url": "http://x", "bogus": 1}, "^openenv: unknown setting bogus; the settings are url, "),
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


@pytest.fixture
def mute_url():
    """A WebSocket server that completes the handshake and never answers a message: the job's check of the
    URL (a handshake) passes, then every session's reset waits for an answer that never comes."""
    import asyncio

    from websockets.asyncio.server import serve

    loop = asyncio.new_event_loop()
    started, done = threading.Event(), None
    port = []

    async def hold(ws):
        await ws.wait_closed()

    async def main():
        nonlocal done
        done = asyncio.Event()
        async with serve(hold, "127.0.0.1", 0, ping_interval=None) as server:
            port.append(server.sockets[0].getsockname()[1])
            started.set()
            await done.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(30), "the mute WebSocket server did not start"
    yield f"http://127.0.0.1:{port[0]}"
    loop.call_soon_threadsafe(done.set)
    thread.join(30)
    loop.close()


_STUCK_LESSON = """\
    - lesson_id: letters
      env: {{name: openenv, args: {{url: "{url}", action_field: message, observation_field: prompt, chat: false,
                                   request_timeout: {wait_s}, max_retries: 3}}}}
      max_tokens: 1
      graduate_at: null"""

LONG_WAIT_S = 300.0
"""The stuck job's long timeouts: each session open's answer (`request_timeout`, 4 tries) and the trainer's
final checkpoint on Ctrl-C (`ray.stop_timeout_s`)."""
STOP_BOUND_S = 60.0
"""How long Ctrl-C may take in the test: six times the documented 10 s (on this 2-core machine it took 3.6 s,
5 s when the trainer was still starting), for a loaded machine; a fifth of LONG_WAIT_S, so a stop that
waits out any of those timeouts fails."""


@pytest.mark.timeout(1200)
def test_ctrl_c_stops_a_job_whose_rollout_worker_waits_on_a_server_that_never_answers(mute_url, tmp_path):
    """`marinrl train` whose rollout worker is stuck opening sessions on a server that accepts and never
    answers (the trainer waits for rollouts that never come, or is still starting): once the stall notice
    shows, Ctrl-C to the process group stops the job without waiting out the server's or the trainer's
    timeouts, exits 130, and leaves no process of the job behind (issue 33)."""
    from job_process import TrainCommand, all_exit, endless_job

    config = tmp_path / "job.yaml"
    config.write_text(endless_job(tmp_path, _STUCK_LESSON.format(url=mute_url, wait_s=LONG_WAIT_S),
                                  f"ray: {{stop_timeout_s: {LONG_WAIT_S}}}\n"))
    notice = f"[marinrl] rollout worker 0 is waiting: openenv: opening a session on {mute_url} (up to 4 tries of 300 s)"
    with TrainCommand(config, tmp_path / "train.log") as job:
        started = job.running_once(lambda: notice in job.output(), "the stall notice")
        assert len(started) >= 3  # at least Ray's GCS, the raylet and the actors' workers
        try:
            job.interrupt(timeout_s=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"Ctrl-C did not stop the job in {STOP_BOUND_S:.0f} s:\n{job.output()[-3000:]}")
    out = job.output()
    assert job.proc.returncode == 130, out[-3000:]
    stopped = re.findall(r"\[marinrl\] stopped [^\r\n]*", out)
    assert stopped and ("before training a step" in stopped[0] or "while the trainer was starting" in stopped[0]), \
        out[-3000:]
    assert "did not stop in time" not in out and "checkpoint None" not in out, out[-3000:]
    all_exit(started)
