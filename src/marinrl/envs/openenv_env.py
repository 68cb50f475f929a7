"""A client for an OpenEnv environment server (docs/environments.md, "OpenEnv"): episodes over its
WebSocket protocol, played by our policy, turn by turn.

    env: {name: openenv, args: {url: "http://localhost:8000", action_field: message, observation_field: prompt}}

One episode is one OpenEnv session (openenv-core's `GenericEnvClient`: a WebSocket to `<url>/ws`, one
environment instance on the server for the session's life): `reset` gives the first observation, and
each model turn's text becomes the action `{action_field: text, **action_args}` sent by `step`, whose
observation, reward and done come back. The episode is one rollout as in envs/episode.py: the prompt is
the first observation's text (`observation_field` of the observation, or the whole observation as JSON;
through the chat template as a user turn, or raw with `chat: false`), the response the model's turns
(loss mask 1, with their sampler logprobs) and the later observations' tokens between them (mask 0),
each step's reward on that turn's last token.

Bounded concurrency: episodes run in waves of at most `max_concurrency` open sessions; each turn of a
wave is one `generate` call for its live episodes (run off the event loop, so the sessions stay
answered), then all their steps at once. Timeouts and retries as the OpenAI environments
(envs/openai_env.py): a session that cannot be opened and reset (refused connection, a full server,
a timeout) is retried with jittered exponential backoff up to `max_retries` times; a step that fails or
exceeds `request_timeout`, or an episode past `episode_timeout`, ends that episode, which is counted
and dropped (its group is smaller); the others go on.

openenv-core is imported when such an environment is built, never when marinrl is imported (the
optional extra `marinrl[openenv]`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from typing import Any, Mapping, Optional

import numpy as np

from marinrl.config.checks import require_above, require_at_least
from marinrl.envs.base import (
    Mode,
    check_sample_args,
    completion_text,
    encode_prompt,
    new_group_id,
    optional_package,
    register_env,
)
from marinrl.envs.episode import EpisodeRecord, episode_metrics, episode_rollout
from marinrl.envs.openai_env import _run_coroutine
from marinrl.inference.context import InferenceContext, SamplingParams, policy_context
from marinrl.logs import ENV_ERRORS, WAITS
from marinrl.types import DEFAULT_AGENT, DEFAULT_POLICY, RolloutGroup

logger = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT_S = 10.0
"""Seconds the check before a job gives the server to answer its WebSocket handshake."""


def import_openenv_client():
    """openenv-core's `GenericEnvClient`, or an error that says how to install it."""
    return optional_package("openenv.core.generic_client", "openenv", "openenv-core", "openenv").GenericEnvClient


@dataclasses.dataclass(frozen=True)
class OpenEnvConfig:
    """How an `OpenEnvEnv` talks to its server and what an episode may use."""

    url: str
    """The server's base URL (`http://host:port`; the WebSocket is `<url>/ws`)."""
    action_field: str = "message"
    """The action's field that carries the model's text."""
    action_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Other fields of every action (constants)."""
    observation_field: Optional[str] = None
    """The observation's field shown to the model; None: the observation as JSON."""
    reset_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of every reset (a `seed` from the lesson's rng is added unless given)."""
    max_turns: int = 4
    """Model turns per episode; an episode still running then is truncated."""
    max_episode_tokens: int = 256
    """Response tokens per episode, turns and observations together."""
    chat: bool = True
    """The first observation as a user turn through the chat template (False: raw text after BOS)."""
    max_concurrency: int = 16
    """Sessions open at once (episodes in a wave)."""
    request_timeout: float = 60.0
    """Seconds for opening a session or one reset / step answer."""
    max_retries: int = 3
    """Retries of opening and resetting a session."""
    backoff_initial: float = 0.5
    """Seconds before the first retry, doubled each time up to `backoff_max`, times U(0.5, 1)."""
    backoff_max: float = 8.0
    episode_timeout: float = 600.0
    """Seconds an episode may take; it is dropped and counted after that."""
    policy: str = DEFAULT_POLICY
    """The policy that plays the episodes (docs/policies.md)."""

    def __post_init__(self):
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"openenv: url must be http(s):// or ws(s)://, got {self.url!r}")
        require_at_least(self, 1, "max_turns", "max_episode_tokens", "max_concurrency")
        require_above(self, 0, "request_timeout", "episode_timeout", "backoff_max")
        require_at_least(self, 0, "max_retries", "backoff_initial")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt` + 1 (the OpenAI environments' schedule)."""
        return min(self.backoff_max, self.backoff_initial * 2**attempt) * random.uniform(0.5, 1.0)


@dataclasses.dataclass
class _Session:
    record: EpisodeRecord
    problem: int
    client: Any = None
    status: str = "ok"  # ok | failed | timed_out
    started: float = 0.0
    open_error: Optional[str] = None
    """Why the session could not be opened (its last try), if it could not."""


@register_env("openenv")
class OpenEnvEnv:
    """Episodes on an OpenEnv server (module docstring). Metrics: those of multi-turn environments
    (`reward_mean`, `turns_mean`, `truncated_frac`, ...) over the episodes that completed, and `episodes`,
    `episodes_failed`, `episodes_timed_out`, `sessions_retried`, `generate_calls`."""

    env_name = "openenv"
    agent_name = DEFAULT_AGENT

    def __init__(self, env_name: str = "openenv", **settings):
        import_openenv_client()
        fields = [f.name for f in dataclasses.fields(OpenEnvConfig)]
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise ValueError(f"openenv: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"the settings are {', '.join(fields)}")
        try:
            self.config = OpenEnvConfig(**settings)
        except TypeError as e:  # a required one missing
            raise ValueError(f"openenv: {e}; the settings are {', '.join(fields)}") from e
        self.env_name = env_name
        self.policy_name = self.config.policy

    def check_reachable(self, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
        """Opens one WebSocket to the server (its handshake, no session reset) before a job starts: a refused
        connection, an HTTP server that is not OpenEnv (404 on `/ws`) or one that never answers is one line
        then, not a job that ends a minute later without its cause. ValueError naming the URL."""
        cfg = self.config
        timeout = min(timeout_s, cfg.request_timeout)

        async def probe():
            client = import_openenv_client()(base_url=cfg.url, connect_timeout_s=timeout, message_timeout_s=timeout)
            try:
                await asyncio.wait_for(client.connect(), timeout=timeout + 1.0)
            finally:
                await _quietly_close(client)

        try:
            _run_coroutine(probe)
        except Exception as e:
            cause = " ".join(str(e).split()) or type(e).__name__
            if isinstance(e, TimeoutError) or "timed out" in cause.lower():
                cause = f"no WebSocket handshake within {timeout:g} s (a server that accepts and never answers?)"
            raise ValueError(f"openenv: cannot open a session on url {cfg.url}: {cause}; start the OpenEnv server "
                             "there or fix args.url") from None

    def observation_text(self, observation: Any) -> str:
        field = self.config.observation_field
        if field is None:
            return observation if isinstance(observation, str) else json.dumps(observation, sort_keys=True)
        if not isinstance(observation, Mapping) or field not in observation:
            keys = sorted(observation) if isinstance(observation, Mapping) else type(observation).__name__
            raise KeyError(f"openenv: the observation has no field {field!r} (it has {keys})")
        return str(observation[field])

    def sample(self, ctx: InferenceContext, n_examples: int, n_generations: int, sampling: SamplingParams,
               rng: np.random.Generator, mode: Mode) -> tuple[list[RolloutGroup], dict[str, float]]:
        check_sample_args(n_examples, n_generations, mode)
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, n_examples)]
        jobs = [(i, seed) for i, seed in enumerate(seeds) for _ in range(n_generations)]
        counts = {"sessions_retried": 0, "generate_calls": 0}
        sessions: list[_Session] = []
        context = policy_context(ctx, self.config.policy)
        k = self.config.max_concurrency
        for start in range(0, len(jobs), k):
            sessions += _run_coroutine(
                lambda start=start: self._wave(context, jobs[start:start + k], sampling, rng, counts))
        groups = []
        for i, seed in enumerate(seeds):
            done = [s.record for s in sessions if s.problem == i and s.status == "ok"]
            if done:
                group_id = new_group_id(self.env_name, f"seed{seed}")
                groups.append(RolloutGroup(tuple(episode_rollout(e, sampling, self.env_name, group_id, self.agent_name,
                                                                 self.policy_name) for e in done)))
        if sessions and all(s.open_error for s in sessions):  # the cause, for the job's last line
            raise ConnectionError(f"{self.env_name}: no session could be opened on {self.config.url} "
                                  f"({len(sessions)} tried, {self.config.max_retries + 1} tries each): "
                                  f"{sessions[-1].open_error}")
        ok = [s.record for s in sessions if s.status == "ok"]
        metrics = episode_metrics(ok, groups) if ok else {}
        metrics.update(episodes=float(len(sessions)), **{f"episodes_{s}": float(sum(x.status == s for x in sessions))
                                                          for s in ("failed", "timed_out")},
                       **{k: float(v) for k, v in counts.items()})
        return groups, metrics

    # ------------------------------------------------------------------ one wave of sessions

    async def _wave(self, ctx, jobs, sampling: SamplingParams, rng: np.random.Generator, counts) -> list[_Session]:
        opened = await asyncio.gather(*(self._open(ctx.tokenizer, i, seed, counts) for i, seed in jobs),
                                      return_exceptions=True)
        sessions = [s for s in opened if isinstance(s, _Session)]
        loop = asyncio.get_running_loop()
        try:
            for s in opened:
                if isinstance(s, BaseException):
                    raise s
            for _ in range(self.config.max_turns):
                live = [s for s in sessions if s.status == "ok" and s.record.finish_reason is None]
                if not live:
                    break
                left = [self.config.max_episode_tokens - len(s.record.response) for s in live]
                budgets = [min(sampling.max_tokens, n) for n in left]
                turn = dataclasses.replace(sampling, max_tokens=max(budgets))
                seed = int(rng.integers(0, 2**31 - 1))
                rows = await loop.run_in_executor(None, ctx.generate, [s.record.tokens for s in live], 1, turn, seed)
                counts["generate_calls"] += 1
                if len(rows) != len(live) or any(len(r) != 1 for r in rows):
                    raise RuntimeError(f"ctx.generate returned {len(rows)} rows for {len(live)} prompts")
                for s, budget, (gen,) in zip(live, budgets, rows):
                    s.record.add_turn(gen.truncated(budget) if len(gen.tokens) > budget else gen,
                                      completion_text(ctx.tokenizer, gen, sampling))
                await asyncio.gather(*(self._step(ctx.tokenizer, s) for s in live))
            for s in sessions:
                if s.status == "ok" and s.record.finish_reason is None:
                    s.record.finish_reason = "length"
        finally:
            await asyncio.gather(*(self._close(s) for s in sessions))
        return list(sessions)

    async def _open(self, tokenizer, problem: int, seed: int, counts) -> _Session:
        cfg = self.config
        session = _Session(EpisodeRecord(problem=None, prompt=[]), problem, started=time.monotonic())
        waiting = (f"{self.env_name}: opening a session on {cfg.url} (up to {cfg.max_retries + 1} tries of "
                   f"{cfg.request_timeout:g} s)")
        for attempt in range(cfg.max_retries + 1):
            client = import_openenv_client()(base_url=cfg.url, connect_timeout_s=cfg.request_timeout,
                                             message_timeout_s=cfg.request_timeout)
            try:
                with WAITS.waiting(waiting):  # shown on the job's terminal while it has not answered
                    await client.connect()
                    result = await client.reset(**{"seed": seed, **dict(cfg.reset_args)})
                text = self.observation_text(result.observation)
                session.client = client
                session.record = EpisodeRecord(problem=None, prompt=encode_prompt(tokenizer, text, chat=cfg.chat))
                return session
            except KeyError:
                await _quietly_close(client)
                raise  # a misconfigured observation_field: every episode would fail the same way
            except Exception as e:  # connection refused, server full, timeout, a closed socket
                await _quietly_close(client)
                if attempt == cfg.max_retries:
                    logger.warning("%s: could not open a session on %s after %d tries: %r", self.env_name, cfg.url,
                                   attempt + 1, e)
                    session.status = "failed"
                    session.open_error = f"{type(e).__name__}: {' '.join(str(e).split())}"
                    return session
                ENV_ERRORS.report(logger, f"{self.env_name}: opening a session on {cfg.url} failed, retrying", e,
                                  level=logging.WARNING, traceback=False)  # in the log from the first try on
                counts["sessions_retried"] += 1
                await asyncio.sleep(cfg.backoff(attempt))
        raise AssertionError("unreachable")

    async def _step(self, tokenizer, s: _Session) -> None:
        cfg = self.config
        left = cfg.episode_timeout - (time.monotonic() - s.started)
        action = {**dict(cfg.action_args), cfg.action_field: s.record.actions[-1]}
        try:
            if left <= 0:
                raise TimeoutError
            with WAITS.waiting(f"{self.env_name}: a step on {cfg.url} (timeout {cfg.request_timeout:g} s)"):
                result = await asyncio.wait_for(s.client.step(action), timeout=min(left, cfg.request_timeout))
        except TimeoutError:
            s.status = "timed_out" if left <= cfg.request_timeout else "failed"  # the episode's clock, or the step's
            logger.warning("%s: an episode's step timed out (%s)", self.env_name, s.status)
            return
        except Exception as e:
            s.status = "failed"
            logger.warning("%s: an episode's step failed: %r", self.env_name, e)
            return
        s.record.add_reward(float(result.reward or 0.0))
        if result.done:
            s.record.finish_reason = "stop"
            return
        observation = [int(t) for t in tokenizer.encode(self.observation_text(result.observation),
                                                          add_special_tokens=False)]
        room = cfg.max_episode_tokens - len(s.record.response) - len(observation)
        if room < 1 or len(s.record.actions) == cfg.max_turns:
            s.record.finish_reason = "length"
            return
        s.record.add_observation(observation)

    async def _close(self, s: _Session) -> None:
        if s.client is not None:
            await _quietly_close(s.client)
            s.client = None


async def _quietly_close(client) -> None:
    try:
        await asyncio.wait_for(client.close(), timeout=5.0)
    except Exception:
        pass
