"""Environments whose episodes are agent code written against the `openai` client: existing agents
train unchanged, through the inference server's OpenAI-compatible endpoint.

    class MyAgent:
        def problems(self, n: int, rng: np.random.Generator, mode: str) -> list: ...
        async def run_episode(self, client: openai.AsyncOpenAI, model: str, problem) -> float | Grade: ...

    EnvConfig(name="openai_agent", args={"agent": "my_pkg.agents:MyAgent", "agent_args": {...}})

The env gives each episode an `openai.AsyncOpenAI` whose base URL is the server's endpoint
(`endpoint_url(ctx)`) and whose API key is the endpoint's (`endpoint_api_key(ctx)`: agents never need
to know it). Under that client sits one `httpx.AsyncClient` (one connection pool, sized to
`max_concurrency`) whose transport retries and records (`agent_calls.py`): every chat completion an episode makes is
kept with its `prompt_token_ids`, `token_ids`, logprobs and finish reason (the endpoint returns them;
the transport asks for logprobs), and the episode becomes a rollout by the stitching rule:

- one call: prompt + response;
- several calls, each call's prompt extending the previous call's prompt + response (what a chat
  template does when the history is re-rendered as it was sampled): one sequence, the tokens between
  two responses (end of turn, the next user message, the assistant header) in the response with
  loss_mask 0 and logprob 0;
- a call whose prompt does not extend the sequence so far (the template re-rendered history
  differently, a response held special tokens or broken UTF-8 that do not survive text round trips,
  the agent edited its history): `on_mismatch="split"` (default) starts a new segment there, and
  segment k of the episodes of one problem forms group k of that problem, each segment carrying the
  episode reward; `on_mismatch="fail"` drops the episode (`episodes_unusable`). Both are counted
  (`episodes_split`).

Episodes run on one asyncio loop, at most `max_concurrency` at a time: a task is created only when a
slot frees up (a semaphore in front of a streaming task pool). A request is retried with exponential
backoff and jitter on connection errors, timeouts, 429 and 5xx; an episode that raises is counted in
`episodes_failed`, one that outlives `episode_timeout` is cancelled and counted in
`episodes_timed_out`; the batch returns with the others. (An agent that blocks the event loop
without awaiting cannot be cut: agents must use the async client.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import logging
import random
import time
from typing import Any, Literal, Mapping, Optional

import httpx
import numpy as np
import openai

from marinrl.config.checks import require_above, require_at_least
from marinrl.envs.agent_calls import CURRENT_EPISODE, AgentTransport, Counts, EpisodeCalls, Segment, Unusable, stitch
from marinrl.envs.base import Grade, Mode, check_sample_args, make_rollout, new_group_id, register_env
from marinrl.inference.context import Generation, InferenceContext, SamplingParams, endpoint_api_key, endpoint_url
from marinrl.types import RolloutGroup

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OpenAIEnvConfig:
    """How an `OpenAIAgentEnv` talks to the endpoint."""

    max_concurrency: int = 32
    """Episodes in flight at once (and connections in the shared pool)."""
    request_timeout: float = 120.0
    """Seconds one HTTP request may take before it is retried."""
    max_retries: int = 3
    """Retries of one request after a connection error, a timeout, 408, 429 or 5xx."""
    backoff_initial: float = 0.5
    """Seconds before the first retry; doubled for each next one, up to `backoff_max`, times a
    random factor in [0.5, 1] (jitter, so that failed requests do not come back together)."""
    backoff_max: float = 8.0
    episode_timeout: float = 600.0
    """Seconds one episode may take; it is cancelled and counted after that."""
    enforce_sampling: bool = True
    """Requests are sampled at the lesson's temperature (the agent's is replaced), and get the lesson's
    max_tokens when the agent gives none; the lesson's token stop sequences do not apply (EOS does)."""
    on_mismatch: Literal["split", "fail"] = "split"
    """A call whose prompt does not extend the episode so far: start a new segment, or drop the episode."""
    model_name: str = "marinrl-policy"
    """The `model` handed to the agent (the endpoint serves its policy whatever the name)."""

    def __post_init__(self):
        require_at_least(self, 1, "max_concurrency")
        require_above(self, 0, "request_timeout", "episode_timeout", "backoff_max")
        require_at_least(self, 0, "backoff_initial", "max_retries")
        if self.on_mismatch not in ("split", "fail"):
            raise ValueError(f"OpenAIEnvConfig.on_mismatch must be 'split' or 'fail', got {self.on_mismatch!r}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt` + 1 (attempt 0 is the first retry)."""
        return min(self.backoff_max, self.backoff_initial * 2**attempt) * random.uniform(0.5, 1.0)


# ---------------------------------------------------------------------------------- the env


@dataclasses.dataclass
class _Outcome:
    problem: int
    status: Literal["ok", "failed", "timed_out", "unusable"]
    grade: Optional[Grade] = None
    segments: tuple[Segment, ...] = ()
    temperature: float = 0.0
    calls: int = 0
    seconds: float = 0.0


def load_agent(agent: Any, agent_args: Optional[Mapping[str, Any]] = None) -> Any:
    """`agent` itself, or the object a dotted path (`pkg.mod:Class`, `pkg.mod.Class`) names, called with
    `agent_args`. It must have `problems(n, rng, mode)` and `async run_episode(client, model, problem)`."""
    if isinstance(agent, str):
        module_name, _, attr = agent.partition(":") if ":" in agent else agent.rpartition(".")
        if not module_name or not attr:
            raise ValueError(f"openai_agent: agent {agent!r} must look like 'package.module:Class'")
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"openai_agent: cannot import module {module_name!r} of agent {agent!r}: {e}") from e
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"openai_agent: module {module_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        agent = obj(**dict(agent_args or {}))
    elif agent_args:
        raise ValueError("openai_agent: agent_args is only for an agent given as a dotted path")
    for method in ("problems", "run_episode"):
        if not callable(getattr(agent, method, None)):
            raise TypeError(f"openai_agent: agent {type(agent).__name__} has no {method}() method")
    if not asyncio.iscoroutinefunction(agent.run_episode):
        raise TypeError(f"openai_agent: {type(agent).__name__}.run_episode must be `async def` (it gets an "
                        "openai.AsyncOpenAI client)")
    return agent


@register_env("openai_agent")
class OpenAIAgentEnv:
    """Runs an agent's episodes through the OpenAI-compatible endpoint and trains on what it sampled
    (module docstring). Metrics: `reward_mean`, `reward_std`, `<indicator>_frac` (over usable
    episodes), `episodes`, `episodes_ok`, `episodes_failed`, `episodes_timed_out`, `episodes_unusable`,
    `episodes_split`, `requests`, `requests_retried`, `requests_failed`, `calls_per_episode_mean`,
    `response_tokens_mean`, `truncated_frac`, `episode_seconds_mean`, `n_samples`."""

    needs_endpoint = True
    """The server running this env serves HTTP (`envs.base.with_endpoint_if_needed`), whatever its config says."""

    def __init__(self, agent: Any, agent_args: Optional[Mapping[str, Any]] = None, env_name: str = "openai_agent",
                 **settings):
        self.agent = load_agent(agent, agent_args)
        self.env_name = env_name
        try:
            self.config = OpenAIEnvConfig(**settings)
        except TypeError as e:
            fields = [f.name for f in dataclasses.fields(OpenAIEnvConfig)]
            raise ValueError(f"openai_agent: unknown setting in {sorted(settings)}; settings are {fields}") from e

    def sample(
        self,
        ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        sampling: SamplingParams,
        rng: np.random.Generator,
        mode: Mode,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        check_sample_args(n_examples, n_generations, mode)
        url, api_key = endpoint_url(ctx), endpoint_api_key(ctx)
        problems = list(self.agent.problems(n_examples, rng, mode))
        jobs = [(i, p, int(rng.integers(0, 2**31 - 1))) for i, p in enumerate(problems) for _ in range(n_generations)]
        counts = Counts()
        started = time.perf_counter()
        outcomes = _run_coroutine(lambda: self._run_all(url, api_key, jobs, sampling, counts))
        elapsed = time.perf_counter() - started
        return self._groups(problems, outcomes), self._metrics(outcomes, counts, elapsed)

    # -------------------------------------------------------------- running episodes

    async def _run_all(self, url: str, api_key: str, jobs, sampling: SamplingParams,
                       counts: Counts) -> list[_Outcome]:
        k = self.config.max_concurrency
        pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=k, max_keepalive_connections=k))
        transport = AgentTransport(pool, counts, max_retries=self.config.max_retries,
                                   backoff=self.config.backoff)
        async with httpx.AsyncClient(transport=transport, timeout=self.config.request_timeout) as http:
            client = openai.AsyncOpenAI(base_url=url, api_key=api_key, http_client=http, max_retries=0,
                                        timeout=self.config.request_timeout)
            slots = asyncio.Semaphore(k)
            tasks = []
            for problem_index, problem, seed in jobs:
                await slots.acquire()  # a task exists only while it holds a slot
                task = asyncio.create_task(self._episode(client, problem_index, problem, seed, sampling))
                task.add_done_callback(lambda _: slots.release())
                tasks.append(task)
            return list(await asyncio.gather(*tasks))

    async def _episode(self, client, problem_index: int, problem, seed: int, sampling: SamplingParams) -> _Outcome:
        episode = EpisodeCalls(seed, sampling, self.config.enforce_sampling)
        CURRENT_EPISODE.set(episode)  # this task's context only; asyncio.wait_for's task inherits it
        started = time.perf_counter()
        out = _Outcome(problem_index, "failed")
        try:
            result = await asyncio.wait_for(
                self.agent.run_episode(client, self.config.model_name, problem), self.config.episode_timeout)
            grade = result if isinstance(result, Grade) else Grade(reward=_reward(result))
            out.grade = grade
            out.status, out.segments, out.temperature = "ok", *self._usable(episode)
        except TimeoutError:
            out.status = "timed_out"
            logger.warning("%s: episode of problem %d cut after %.1f s", self.env_name, problem_index,
                           self.config.episode_timeout)
        except Unusable as e:
            out.status = "unusable"
            logger.warning("%s: episode of problem %d not trainable: %s", self.env_name, problem_index, e)
        except Exception:
            logger.exception("%s: episode of problem %d failed", self.env_name, problem_index)
        out.calls, out.seconds = len(episode.calls), time.perf_counter() - started
        return out

    def _usable(self, episode: EpisodeCalls) -> tuple[tuple[Segment, ...], float]:
        if episode.problems:
            raise Unusable(episode.problems[0])
        if not episode.calls:
            raise Unusable("the episode made no chat completion")
        temperatures = {c.temperature for c in episode.calls}
        if len(temperatures) > 1:
            raise Unusable(f"calls sampled at several temperatures {sorted(temperatures)}; a rollout has one")
        segments = stitch(episode.calls)
        if len(segments) > 1 and self.config.on_mismatch == "fail":
            raise Unusable(f"a call's prompt does not extend the episode so far ({len(segments)} segments)")
        return tuple(segments), temperatures.pop()

    # -------------------------------------------------------------- rollouts and metrics

    def _groups(self, problems: list, outcomes: list[_Outcome]) -> list[RolloutGroup]:
        by_key: dict[tuple[int, int], list] = {}
        for out in outcomes:
            if out.status != "ok":
                continue
            for k, seg in enumerate(out.segments):
                by_key.setdefault((out.problem, k), []).append((seg, out))
        groups = []
        for (i, k), members in sorted(by_key.items()):
            example = _example_id(problems[i])
            group_id = new_group_id(self.env_name, f"{example}#{k}" if k else example)
            rollouts = []
            for seg, out in members:
                gen = Generation(tokens=np.asarray(seg.tokens, np.int32), logprobs=np.asarray(seg.logprobs, np.float32),
                                 finish_reason=seg.finish_reason)
                rollouts.append(make_rollout(seg.prompt, gen, reward=out.grade.reward, temperature=out.temperature,
                                             env_name=self.env_name, group_id=group_id,
                                             loss_mask=np.asarray(seg.loss_mask, bool)))
            groups.append(RolloutGroup(tuple(rollouts)))
        return groups

    def _metrics(self, outcomes: list[_Outcome], counts: Counts, elapsed: float) -> dict[str, float]:
        ok = [o for o in outcomes if o.status == "ok"]
        m: dict[str, float] = {f"episodes_{s}": float(sum(o.status == s for o in outcomes))
                               for s in ("ok", "failed", "timed_out", "unusable")}
        m.update(episodes=float(len(outcomes)), episodes_split=float(sum(len(o.segments) > 1 for o in ok)),
                 requests=float(counts.requests), requests_retried=float(counts.requests_retried),
                 requests_failed=float(counts.requests_failed),
                 calls_per_episode_mean=float(np.mean([o.calls for o in outcomes])),
                 episode_seconds_mean=float(np.mean([o.seconds for o in outcomes])),
                 episodes_per_second=len(outcomes) / max(elapsed, 1e-9), n_samples=float(len(ok)))
        if ok:
            rewards = [o.grade.reward for o in ok]
            segs = [s for o in ok for s in o.segments]
            m.update(reward_mean=float(np.mean(rewards)), reward_std=float(np.std(rewards)),
                     response_tokens_mean=float(np.mean([sum(s.loss_mask) for s in segs])),
                     truncated_frac=float(np.mean([o.segments[-1].finish_reason == "length" for o in ok])))
            for name in sorted({k for o in ok for k in o.grade.indicators}):
                m[f"{name}_frac"] = float(np.mean([o.grade.indicators.get(name, 0.0) for o in ok]))
        return m


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not np.isfinite(value):
        raise TypeError(f"run_episode must return a finite number or a Grade, got {value!r}")
    return float(value)


def _example_id(problem: Any) -> str:
    if isinstance(problem, Mapping):
        return str(problem.get("example_id", ""))
    return str(getattr(problem, "example_id", "") or "")


def _run_coroutine(make):
    """Run `make()` to completion from synchronous code: on a fresh loop in this thread, or, when this
    thread already runs a loop (a notebook, an async caller), on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="marinrl-openai-env") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
