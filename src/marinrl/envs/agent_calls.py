"""What an agent's episode sent and got back (envs/openai_env.py): the HTTP transport under its `openai` client,
which retries with backoff and records each chat completion of the current episode, and the stitching rule that
turns an episode's calls into rollout segments (a call extends the segment when its prompt starts with the
segment's prompt + response; otherwise it starts a new one).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
from typing import Callable, Optional, Sequence

import httpx

from marinrl.inference.context import SamplingParams

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclasses.dataclass(frozen=True)
class Call:
    """One chat completion an episode made, as the endpoint sampled it."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    temperature: float


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive calls stitched into one sequence: a rollout's prompt and response."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    finish_reason: str


def stitch(calls: Sequence[Call]) -> list[Segment]:
    """The segments of an episode's calls (module docstring): a call extends the current segment when
    its prompt starts with the segment's prompt + response; otherwise it starts a new segment."""
    segments: list[Segment] = []
    full: list[int] = []
    for call in calls:
        prompt = list(call.prompt)
        if segments and len(prompt) >= len(full) and prompt[: len(full)] == full:
            seg = segments[-1]
            between = prompt[len(full):]
            seg.tokens.extend(between + list(call.tokens))
            seg.logprobs.extend([0.0] * len(between) + list(call.logprobs))
            seg.loss_mask.extend([0] * len(between) + [1] * len(call.tokens))
            segments[-1] = dataclasses.replace(seg, finish_reason=call.finish_reason)
        else:
            segments.append(Segment(prompt, list(call.tokens), list(call.logprobs), [1] * len(call.tokens),
                                    call.finish_reason))
        full = prompt + list(call.tokens)
    return segments


class Unusable(Exception):
    """An episode whose calls cannot become rollouts (the message says why)."""


class EpisodeCalls:
    """What one episode sent and got back; the transport finds it through `CURRENT_EPISODE`."""

    def __init__(self, seed: int, sampling: SamplingParams, enforce: bool):
        self.seed = seed
        self.sampling = sampling
        self.enforce = enforce
        self.calls: list[Call] = []
        self.problems: list[str] = []

    def rewrite(self, request: httpx.Request) -> httpx.Request:
        """Ask for logprobs, give the lesson's sampling settings and a seed per call."""
        body = json.loads(request.content)
        body["logprobs"] = True
        if self.enforce:
            body["temperature"] = self.sampling.temperature
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = self.sampling.max_tokens
        if body.get("seed") is None:
            body["seed"] = (self.seed + len(self.calls) + len(self.problems)) % (1 << 31)
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
        return httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode(),
                             extensions=request.extensions)

    def record(self, request: httpx.Request, body: bytes) -> None:
        sent, got = json.loads(request.content), json.loads(body)
        try:
            prompt = tuple(int(t) for t in got["prompt_token_ids"])
            choices = got["choices"]
            if len(choices) != 1:
                raise Unusable(f"a call asked for n={len(choices)} choices; an episode can train on n=1 only")
            (choice,) = choices
            tokens = tuple(int(t) for t in choice["token_ids"])
            logprobs = tuple(float(c["logprob"]) for c in choice["logprobs"]["content"])
        except (KeyError, TypeError) as e:
            raise Unusable(f"the response has no token ids or logprobs ({e!r}): is this a marinrl endpoint?") from e
        if len(tokens) != len(logprobs):
            raise Unusable(f"the response has {len(tokens)} token ids but {len(logprobs)} logprobs")
        self.calls.append(Call(prompt, tokens, logprobs, choice["finish_reason"], float(sent.get("temperature", 1.0))))


CURRENT_EPISODE: contextvars.ContextVar[Optional[EpisodeCalls]] = contextvars.ContextVar(
    "marinrl_openai_episode", default=None)
"""The episode the running task belongs to: each episode task sets its own."""


@dataclasses.dataclass
class Counts:
    """Requests the transport sent, retried, and gave up on."""

    requests: int = 0
    requests_retried: int = 0
    requests_failed: int = 0


class AgentTransport(httpx.AsyncBaseTransport):
    """The shared pool's transport: retries with backoff, and records the current episode's chat
    completions (requests outside an episode pass through unrecorded)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, counts: Counts, *, max_retries: int,
                 backoff: Callable[[int], float]):
        """`backoff(attempt)`: seconds to wait before retry `attempt` + 1."""
        self._inner = inner
        self._counts = counts
        self._max_retries = max_retries
        self._backoff = backoff

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        episode = CURRENT_EPISODE.get()
        chat = episode is not None and request.method == "POST" and request.url.path.endswith("/chat/completions")
        if chat:
            request = episode.rewrite(request)
        response = await self._send(request)
        if not (chat and response.status_code == 200):
            return response
        body = await response.aread()
        await response.aclose()
        try:
            episode.record(request, body)
        except Unusable as e:
            episode.problems.append(str(e))
        headers = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=body, request=request,
                              extensions={k: v for k, v in response.extensions.items() if k != "network_stream"})

    async def _send(self, request: httpx.Request) -> httpx.Response:
        self._counts.requests += 1
        for attempt in range(self._max_retries + 1):
            last = attempt == self._max_retries
            try:
                response = await self._inner.handle_async_request(request)
            except httpx.TransportError:  # connection errors and timeouts
                if last:
                    self._counts.requests_failed += 1
                    raise
            else:
                if response.status_code not in RETRY_STATUS:
                    return response
                if last:
                    self._counts.requests_failed += 1
                    return response
                await response.aclose()
            self._counts.requests_retried += 1
            await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._inner.aclose()
