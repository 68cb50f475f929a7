"""verifiers 0.4 environments (the library behind the environments hub), run out of process
(docs/environments.md, "verifiers").

    env: {name: verifiers, args: {env_id: vf_letter, python: .venv-verifiers/bin/python,
                                  env_args: {agent: {runtime: {type: subprocess}}}}}

verifiers cannot be installed beside marinrl's pins, so it lives in a virtualenv of its own and marinrl never
imports it. Two processes of that virtualenv's interpreter run `verifiers_bridge.py` (this package's script, which
imports only the standard library and verifiers):

- `serve`: verifiers' own `EnvServer` for the environment (ZeroMQ), one per rollout host, started at the first
  `sample`, restarted when it dies, stopped with the host (it ends when its stdin, our pipe, closes); or none,
  when `server_address` names a running one;
- `client`: loads the taskset's tasks (the train split, and the eval split of `eval_env_args`), and runs each
  episode as one `RunRequest` through verifiers' `EnvClient`, its model client a `TrainClientConfig` pointing at
  our inference server's token endpoint (`/inference/v1/generate`, the endpoint's API key in the server's
  `api_key_var`): the environment renders its chat turns to tokens with the policy's tokenizer and samples token
  ids and logprobs from our policy. It answers each run with the episode's traces as token sequences.

Each trace's trainable branch becomes a rollout: the prompt is everything before the first sampled token, the
response the rest, the loss mask verifiers' sampled mask (0 on tool results, user turns and template tokens
between the model's turns), the sampler's logprobs, the rubric's reward (the sum of its weighted scores) on the
last token; each reward function's score and each metric are reported as metrics. The n_generations episodes of
a task form one group per agent.

Failures: an episode whose task raised (verifiers records the error on the trace) is counted in
`episodes_failed`; one past `episode_timeout` is cancelled and counted in `episodes_timed_out`; an EnvServer that
dies is restarted and the episodes it held run again, up to `max_retries` times each (`server_restarts`,
`episodes_retried`). A call in which no episode finished raises with the cause, which the job's failure budget
(`max_consecutive_env_failures`) turns into its last line. The interpreter, verifiers' version and the
environment id are checked before a job starts (`check_reachable`, run by the job's preflight).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import pathlib
import socket
import tempfile
import threading
import time
from typing import Optional

import numpy as np

from marinrl.config.env import VerifiersEnvConfig
from marinrl.envs.base import Mode, check_sample_args, make_rollout, new_group_id, register_env
from marinrl.envs.verifiers_process import BridgeDied, BridgeProcess, last_words, run_noticed, tail
from marinrl.inference.context import Generation, InferenceContext, SamplingParams, endpoint_api_key, endpoint_url
from marinrl.logs import ENV_ERRORS, WAITS
from marinrl.types import DEFAULT_AGENT, RolloutGroup

logger = logging.getLogger(__name__)

BRIDGE = pathlib.Path(__file__).with_name("verifiers_bridge.py")
PROTOCOL = 1
"""The bridge's line protocol (verifiers_bridge.PROTOCOL)."""
SUPPORTED_VERIFIERS = ("0.4.",)
"""verifiers versions whose serve protocol and trace format this adapter speaks."""
PREFLIGHT_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 10.0
"""Seconds the check before a job waits for a `server_address` EnvServer to answer a health request."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deep_merge(base: dict, over: Optional[dict]) -> dict:
    """`over` merged into a copy of `base`, dicts key by key."""
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def env_config_data(cfg: VerifiersEnvConfig, eval_split: bool = False) -> dict:
    """verifiers' EnvConfig data of the lesson (`eval_split`: its eval tasks' taskset)."""
    args = deep_merge(cfg.env_args, cfg.eval_env_args) if eval_split else dict(cfg.env_args)
    return {**args, "taskset": {**dict(args.get("taskset") or {}), "id": cfg.env_id}}


@dataclasses.dataclass
class _Episode:
    problem: int
    """Which of the call's n_examples draws (its group)."""
    task: int
    seed: int
    tries: int = 0
    status: str = "pending"  # ok | failed | timed_out
    answer: Optional[dict] = None
    error: Optional[str] = None


@register_env("verifiers")
class VerifiersEnv:
    """A verifiers environment served by an EnvServer out of process (module docstring). Metrics: `episodes`,
    `episodes_ok`, `episodes_failed`, `episodes_timed_out`, `episodes_retried`, `server_restarts`, `reward_mean`,
    `reward_std`, `reward/<function>_mean` (each reward function's score), `metric/<name>_mean`,
    `response_tokens_mean`, `trained_tokens_mean`, `truncated_frac`, `zero_variance_groups_frac`, `n_samples`."""

    env_name = "verifiers"
    needs_endpoint = True
    """The EnvServer samples through the token endpoint of the job's inference server (it must serve HTTP)."""

    def __init__(self, env_name: str = "verifiers", **settings):
        fields = [f.name for f in dataclasses.fields(VerifiersEnvConfig)]
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise ValueError(f"verifiers: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"the settings are {', '.join(fields)}")
        try:
            self.config = VerifiersEnvConfig(**settings)
        except TypeError as e:  # env_id missing
            raise ValueError(f"verifiers: {e}; the settings are {', '.join(fields)}") from e
        python = self.config.python
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"verifiers: python {python} is not an executable file; build the virtualenv "
                             "(`make verifiers-venv`, or python3.11 -m venv DIR && DIR/bin/pip install "
                             "verifiers==0.4.0) and name its bin/python")
        self.env_name = env_name
        self.policy_name = self.config.policy
        self._lock = threading.Lock()
        self._server: Optional[BridgeProcess] = None
        self._client: Optional[BridgeProcess] = None
        self._tasks: dict[str, int] = {}
        self._started_key: Optional[tuple] = None
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self.server_restarts = 0

    @property
    def label(self) -> str:
        return f"verifiers environment {self.config.env_id!r}"

    def _bridge_config(self, **extra) -> str:
        cfg = self.config
        return json.dumps({"env": env_config_data(cfg), "eval_env": env_config_data(cfg, eval_split=True),
                           "max_tasks": cfg.max_tasks, **extra})

    def _argv(self, mode: str, **extra) -> list[str]:
        # -P: the script's folder (marinrl/envs, whose math.py would shadow the standard library) stays off sys.path
        return [self.config.python, "-P", str(BRIDGE), mode, self._bridge_config(**extra)]

    # ------------------------------------------------------------------ before a job

    def check_reachable(self, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
        """Before Ray starts: the interpreter runs, has verifiers of a supported version, the environment id loads
        and its taskset yields tasks (both splits); a `server_address` answers verifiers' health request.
        ValueError naming the environment and the cause. A wait past `WAIT_NOTICE_S` (verifiers_process.py) is
        shown on the terminal."""
        python = self.config.python
        timeout = min(timeout_s, self.config.start_timeout)
        address = self.config.server_address
        limit = timeout + (HEALTH_TIMEOUT_S if address is not None else 0.0)
        argv = self._argv("check", address=address, health_timeout=HEALTH_TIMEOUT_S)
        code, out, err = run_noticed(argv, limit, f"{python} to load the {self.label}")
        if code is None:
            said = last_words(out, err)
            said = said if said == "it printed nothing" else f"it printed: {said}"
            raise ValueError(f"{self.label}: {python} did not load it within {limit:g} s ({said}); check that "
                             f"`{python} -c 'import verifiers'` returns (a wrapper waiting for input? a slow network "
                             "filesystem?)")
        lines = out.strip().splitlines()
        try:
            answer = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            cause = last_words(out, err)
            if cause == "it printed nothing":
                cause += (f": is it a Python 3.11+ interpreter of a virtualenv with verifiers? "
                          f"`{python} -c 'import verifiers'` should run")
            raise ValueError(f"{self.label}: {python} could not run the bridge (exit {code}): {cause}") from None
        if "error" in answer:
            cause = answer["error"]
            if "No module named 'verifiers'" in cause:
                cause = f"verifiers is not installed there ({cause}); pip install verifiers==0.4.0 into it"
            raise ValueError(f"{self.label} does not load with {self.config.python}: {cause}")
        self._check_versions(answer)
        empty = [split for split, n in answer["tasks"].items() if n == 0]
        if empty:
            raise ValueError(f"{self.label}: its taskset yields no {' and no '.join(empty)} tasks")
        if self.config.server_address is not None and not answer.get("healthy"):
            raise ValueError(self._unhealthy(HEALTH_TIMEOUT_S))

    def _unhealthy(self, timeout: float) -> str:
        return (f"{self.label}: no EnvServer answers at {self.config.server_address} (verifiers' health request, "
                f"{timeout:g} s): start it there, or fix args.server_address")

    def _check_versions(self, answer: dict) -> None:
        if answer.get("protocol") != PROTOCOL:
            raise ValueError(f"{self.label}: the bridge speaks protocol {answer.get('protocol')!r}, this marinrl "
                             f"{PROTOCOL}: a verifiers_bridge.py from another marinrl version?")
        version = str(answer.get("verifiers"))
        if not version.startswith(SUPPORTED_VERIFIERS):
            raise ValueError(f"{self.label}: {self.config.python} has verifiers {version}; marinrl speaks the serve "
                             f"protocol of verifiers {', '.join(v + 'x' for v in SUPPORTED_VERIFIERS)} "
                             "(pip install verifiers==0.4.0 there)")

    def _expect_healthy(self, client: BridgeProcess, timeout: float) -> None:
        answer = client.request(op="health", timeout=timeout).result(timeout + 30)
        if not answer.get("healthy"):
            raise ValueError(self._unhealthy(timeout))

    # ------------------------------------------------------------------ the processes

    def _spawn_client(self, tmp: str, address: str, base_url: str = "", env: Optional[dict] = None) -> BridgeProcess:
        argv = self._argv("client", address=address, base_url=base_url, api_key_var=self.config.api_key_var,
                          renderer_model=self._renderer_model, renderer=self.config.renderer)
        return BridgeProcess(argv, dict(os.environ) if env is None else env, os.path.join(tmp, "client.log"),
                        "task client")

    def _wait_ready(self, client: BridgeProcess) -> None:
        self._check_versions(json.loads(client.first_line(self.config.start_timeout)))

    _renderer_model: Optional[str] = None

    def _ensure_started(self, ctx: InferenceContext) -> None:
        """Start (or restart) the EnvServer and the client, once per endpoint."""
        url, api_key = endpoint_url(ctx), endpoint_api_key(ctx)
        key = (url, api_key)
        if self._started_key == key and self._client is not None and self._client.alive() and (
                self._server is None and self.config.server_address is not None
                or self._server is not None and self._server.alive()):
            return
        if self._started_key is not None:
            self.server_restarts += 1
            logger.warning("%s: restarting its EnvServer (%s)", self.label,
                           "server died" if self._server is not None and not self._server.alive() else "client died")
        self.close()
        self._tmp = tempfile.TemporaryDirectory(prefix="marinrl-verifiers-")
        tmp = self._tmp.name
        if self.config.renderer_model is not None:
            self._renderer_model = self.config.renderer_model
        else:
            self._renderer_model = os.path.join(tmp, "tokenizer")
            ctx.tokenizer.save_pretrained(self._renderer_model)
        env = dict(os.environ)
        env[self.config.api_key_var] = api_key
        address = self.config.server_address
        with WAITS.waiting(f"{self.label}: starting its EnvServer and task client (up to "
                           f"{self.config.start_timeout:g} s)"):
            if address is None:  # both start at once (each imports verifiers: seconds); ZeroMQ connects before a bind
                address = f"tcp://127.0.0.1:{_free_port()}"
                self._server = BridgeProcess(self._argv("serve", bind=address), env, os.path.join(tmp, "server.log"),
                                        "EnvServer")
            self._client = self._spawn_client(tmp, address, url, env)
            if self._server is not None:
                line = self._server.first_line(self.config.start_timeout)
                if not line.startswith("address "):
                    raise RuntimeError(f"{self.label}: the EnvServer said {line!r}: {tail(self._server.log_path)}")
            self._wait_ready(self._client)
            if self.config.server_address is not None:
                self._expect_healthy(self._client, self.config.start_timeout)
            hello = self._client.request(op="hello").result(self.config.start_timeout)
        if "error" in hello:
            raise RuntimeError(f"{self.label}: {hello['error']}")
        self._tasks = dict(hello["tasks"])
        self._started_key = key

    def close(self) -> None:
        """Stop the EnvServer and the client (a later `sample` starts them again)."""
        for proc in (self._client, self._server):
            if proc is not None:
                proc.stop()
        self._client = self._server = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ sampling

    def sample(self, ctx: InferenceContext, n_examples: int, n_generations: int, sampling: SamplingParams,
               rng: np.random.Generator, mode: Mode) -> tuple[list[RolloutGroup], dict[str, float]]:
        check_sample_args(n_examples, n_generations, mode)
        with self._lock:
            return self._sample(ctx, n_examples, n_generations, sampling, rng, mode)

    def _sample(self, ctx, n_examples, n_generations, sampling, rng, mode):
        cfg = self.config
        restarts_before = self.server_restarts
        self._ensure_started(ctx)
        split = "eval" if mode == "eval" else "train"
        n_tasks = self._tasks[split]
        if n_tasks == 0:
            raise ValueError(f"{self.label}: its taskset yields no {split} tasks")
        tasks = [int(t) for t in rng.integers(0, n_tasks, n_examples)]
        episodes = [_Episode(i, t, int(rng.integers(0, 2**31 - 1))) for i, t in enumerate(tasks)
                    for _ in range(n_generations)]
        counts = collections.Counter()
        queue = collections.deque(episodes)

        def retry_or_fail(e: _Episode) -> None:  # its process died under it: run again while tries are left
            if e.tries < cfg.max_retries:
                e.tries += 1
                counts["episodes_retried"] += 1
                queue.append(e)
            else:
                e.status = "failed"

        running: dict[concurrent.futures.Future, _Episode] = {}
        started: dict[concurrent.futures.Future, float] = {}
        sampling_wire = {"temperature": float(sampling.temperature), "max_tokens": int(sampling.max_tokens)}
        with WAITS.waiting(f"{self.label}: {len(episodes)} episodes on its EnvServer"):
            while queue or running:
                while queue and len(running) < cfg.max_concurrency:
                    e = queue.popleft()
                    future = self._client.request(op="run", split=split, index=e.task, model=cfg.model_name,
                                                  sampling={**sampling_wire, "seed": e.seed},
                                                  timeout=cfg.episode_timeout)
                    running[future] = e
                    started[future] = time.monotonic()
                done, _ = concurrent.futures.wait(list(running), timeout=1.0,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                died = False
                for future in done:
                    e = running.pop(future)
                    started.pop(future)
                    try:
                        answer = future.result()
                    except BridgeDied as err:
                        died = True
                        e.error = str(err)
                        retry_or_fail(e)
                        continue
                    self._settle(e, answer)
                now = time.monotonic()
                for future, t0 in list(started.items()):  # the bridge's own timeout did not answer: ours
                    if now - t0 > cfg.episode_timeout + 30:
                        e = running.pop(future)
                        started.pop(future)
                        e.status, e.error = "timed_out", f"no answer within {cfg.episode_timeout:g} s"
                server_dead = self._server is not None and not self._server.alive()
                if died or server_dead or (running and not self._client.alive()):
                    for future, e in list(running.items()):  # the others of the dead process: run again
                        running.pop(future)
                        started.pop(future)
                        retry_or_fail(e)
                    if queue:
                        self._ensure_started(ctx)
        return self._result(episodes, tasks, n_generations, sampling, counts, self.server_restarts - restarts_before)

    def _settle(self, e: _Episode, answer: dict) -> None:
        if "error" in answer:
            e.status = "timed_out" if answer.get("timeout") else "failed"
            e.error = answer["error"]
            return
        traces = answer.get("traces") or []
        bad = [t for t in traces if not t["ok"]]
        if not traces or bad:
            e.status = "timed_out" if any(t["is_timeout"] for t in bad) else "failed"
            errors = [err for t in bad for err in t["errors"]] + list(answer.get("errors") or [])
            e.error = errors[-1] if errors else "the episode produced no trace"
            return
        e.status, e.answer = "ok", answer

    def _result(self, episodes, tasks, n_generations, sampling, counts, restarts):
        ok = [e for e in episodes if e.status == "ok"]
        for e in episodes:
            if e.status != "ok":
                ENV_ERRORS.report(logger, f"{self.label}: an episode {e.status.replace('_', ' ')}: {e.error}",
                                  level=logging.WARNING, traceback=False)
        if episodes and not ok:
            last = next((e.error for e in reversed(episodes) if e.error), "no error recorded")
            raise RuntimeError(f"{self.label}: no episode finished ({len(episodes)} tried: "
                               f"{sum(e.status == 'failed' for e in episodes)} failed, "
                               f"{sum(e.status == 'timed_out' for e in episodes)} timed out); last error: {last}")
        by_group: dict[tuple, list] = collections.defaultdict(list)
        rewards, lengths, trained, truncated = [], [], [], []
        scores: dict[str, list[float]] = collections.defaultdict(list)
        for e in ok:
            for trace in e.answer["traces"]:
                for k, v in trace["rewards"].items():
                    if v is not None and math.isfinite(v):
                        scores[f"reward/{k}_mean"].append(v)
                for k, v in trace["metrics"].items():
                    if v is not None and math.isfinite(v):
                        scores[f"metric/{k}_mean"].append(v)
                for b, s in enumerate(trace["samples"]):
                    by_group[(e.problem, e.task, trace["agent"], b)].append((s, float(trace["reward"])))
        groups = []
        for (_, task, agent, b), samples in by_group.items():
            group_id = new_group_id(self.env_name, f"{self.config.env_id}:{task}" + (f"#{b}" if b else ""))
            rollouts = []
            for s, reward in samples:
                tokens = np.asarray(s["completion"], np.int32)
                mask = np.asarray(s["mask"], bool)
                logprobs = np.where(mask, np.asarray(s["logprobs"], np.float32), 0.0).astype(np.float32)
                finish = "length" if s["finish_reason"] == "length" else "stop"
                rollouts.append(make_rollout(
                    s["prompt"], Generation(tokens, logprobs, finish), reward=reward,
                    temperature=sampling.temperature, env_name=self.env_name, group_id=group_id, loss_mask=mask,
                    agent_name=DEFAULT_AGENT if agent == "agent" else agent, policy_name=self.policy_name))
                rewards.append(reward)
                lengths.append(tokens.size)
                trained.append(int(mask.sum()))
                truncated.append(finish == "length")
            groups.append(RolloutGroup(tuple(rollouts)))
        metrics = {
            "episodes": float(len(episodes)),
            "episodes_ok": float(len(ok)),
            "episodes_failed": float(sum(e.status == "failed" for e in episodes)),
            "episodes_timed_out": float(sum(e.status == "timed_out" for e in episodes)),
            "episodes_retried": float(counts["episodes_retried"]),
            "server_restarts": float(restarts),
            "n_samples": float(len(rewards)),
        }
        if rewards:
            metrics.update(
                reward_mean=float(np.mean(rewards)), reward_std=float(np.std(rewards)),
                response_tokens_mean=float(np.mean(lengths)), trained_tokens_mean=float(np.mean(trained)),
                truncated_frac=float(np.mean(truncated)),
                zero_variance_groups_frac=float(np.mean([np.all(g.rewards == g.rewards[0]) for g in groups])))
        metrics.update({k: float(np.mean(v)) for k, v in scores.items()})
        return groups, metrics
