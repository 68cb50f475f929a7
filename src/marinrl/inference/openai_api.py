"""The OpenAI-compatible HTTP endpoint (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`), for environments and evaluators that speak that protocol, and the token endpoint beside it
(`/inference/v1/generate`, vLLM's token-in/token-out route: `token_endpoint.py`).

The endpoint needs one thing from the server behind it: a function that generates for token prompts,
`generate(list[TokenRequest]) -> list[list[Generation]]` (`InferenceServer.generate_requests`, over
the scan sampler or Levanter's engine). Responses carry the token ids beside the text, in vLLM's
convention: `prompt_token_ids` (chat: on the response; completions: on each choice) and `token_ids`
on each choice, aligned one to one with the choice's logprobs, so that agent code's calls can be
trained on without re-tokenizing text.

Ours rather than Levanter's `InferenceServer`, whose `finish_reason` is always "stop", which merges
several `stop` strings into one sequence and ignores `top_p`. Here `finish_reason` is "length" when
`max_tokens` ran out and "stop" on EOS or a stop string; each stop string works on its own, and the
returned text ends before it (OpenAI's rule); unsupported options (`stream`, `echo`, `top_p` other than
1, penalties, `logit_bias`, `best_of` > 1) are refused with 400, never ignored.

Every request but `GET /health` must carry the endpoint's API key (`api_auth`: 401 without it).

Requests are served by one worker thread that batches whatever is queued into one `generate` call.
Lifecycle: `start()` binds the port and starts the threads, `wait_until_ready()` blocks until uvicorn
serves, `shutdown()` stops both threads and closes the port.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import random
import socket
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence, Union

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel, ConfigDict

from marinrl.config.checks import check_api_key
from marinrl.inference import token_endpoint
from marinrl.inference.api_auth import RequireApiKey, new_api_key, openai_error
from marinrl.inference.context import Generation, SamplingParams, chat_prompt_tokens

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenRequest:
    """One prompt of one HTTP request, as the endpoint hands it to its generate function."""

    prompt: Sequence[int]
    n: int
    sampling: SamplingParams
    seed: int
    index: int = 0
    """The prompt's position in its HTTP request: sample j depends on (seed, index, j) only."""


GenerateFn = Callable[[Sequence[TokenRequest]], list[list[Generation]]]
"""Samples of each request, in order; raises ValueError (naming the problem) for a request it cannot serve."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None


def _refuse_unsupported(req: _Request) -> None:
    problems = []
    if req.stream:
        problems.append("stream")
    if req.top_p is not None and req.top_p != 1.0:
        problems.append("top_p other than 1")
    if req.presence_penalty or req.frequency_penalty:
        problems.append("presence/frequency penalties")
    if req.logit_bias:
        problems.append("logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            problems.append("echo")
        if req.best_of not in (None, 1):
            problems.append("best_of > 1")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs:
        problems.append("top_logprobs")
    if problems:
        raise HTTPException(status_code=400, detail=f"unsupported: {', '.join(problems)}")
    if req.n < 1:
        raise HTTPException(status_code=400, detail=f"n must be >= 1, got {req.n}")
    if req.temperature < 0:
        raise HTTPException(status_code=400, detail=f"temperature must be >= 0, got {req.temperature}")


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise HTTPException(status_code=400, detail="empty stop string")
    return stops


class _Finished:
    """One choice after OpenAI's stop rules: text ends before the first stop string."""

    def __init__(self, tokenizer, sample: Generation, stop_strings: Sequence[str]):
        tokens = [int(t) for t in sample.tokens]
        logprobs = [float(x) for x in sample.logprobs]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop_strings if s in text]
        finish = sample.finish_reason
        if cuts:
            # the shortest token prefix whose text holds a stop string ("contains" grows with the prefix)
            lo, hi = 1, len(tokens)
            while lo < hi:
                mid = (lo + hi) // 2
                part = tokenizer.decode(tokens[:mid], skip_special_tokens=True)
                if any(s in part for s in stop_strings):
                    hi = mid
                else:
                    lo = mid + 1
            tokens, logprobs, text, finish = tokens[:lo], logprobs[:lo], text[: min(cuts)], "stop"
        self.tokens, self.logprobs, self.text, self.finish_reason = tokens, logprobs, text, finish


class _Server(uvicorn.Server):
    """uvicorn's server, telling us when it actually listens (after lifespan startup and socket setup)."""

    def __init__(self, config: uvicorn.Config, on_started):
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._on_started()


class OpenAIEndpoint:
    """OpenAI-compatible HTTP server over a generate function, on `host:port` (port 0: any free port).
    Every request but `/health` needs `api_key` (None: a random key, read it from `api_key`)."""

    def __init__(
        self,
        generate: GenerateFn,
        tokenizer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "marinrl-policy",
        default_max_tokens: int = 256,
        api_key: Optional[str] = None,
        max_model_len: Optional[int] = None,
        vocab_size: Optional[int] = None,
    ):
        """`max_model_len`: the longest prompt + generation the generate function serves (None: no
        limit known), which `/v1/models` reports as vLLM does; `vocab_size`: the model's (default: the
        tokenizer's length), against which the token endpoint checks token ids."""
        self._api_key = new_api_key() if api_key is None else check_api_key(api_key)
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer) if vocab_size is None else vocab_size
        self.generate = generate
        self.tokenizer = tokenizer
        self.host = host
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self._requested_port = port
        self._jobs: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self._socket: Optional[socket.socket] = None
        self._server: Optional[uvicorn.Server] = None
        self._http_thread: Optional[threading.Thread] = None
        self._worker_thread: Optional[threading.Thread] = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("OpenAIEndpoint is not started")
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        """Base URL for an OpenAI client: http://host:port/v1."""
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.port}/v1"

    @property
    def api_key(self) -> str:
        """The key every request (but `/health`) must send as `Authorization: Bearer <key>`."""
        return self._api_key

    def start(self) -> OpenAIEndpoint:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        self._socket = sock
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self._server = _Server(config, on_started=self._ready.set)
        self._worker_thread = threading.Thread(target=self._work, name="marinrl-openai-generate", daemon=True)
        self._worker_thread.start()
        self._http_thread = threading.Thread(target=self._serve, name="marinrl-openai-http", daemon=True)
        self._http_thread.start()
        return self

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as e:  # noqa: BLE001 - reported by wait_until_ready
            self._startup_error = e
            logger.exception("OpenAI endpoint stopped with an error")
        finally:
            self._ready.set()  # unblock waiters; they check whether it actually started

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        """Block until the endpoint accepts requests; raise if it failed to start or `timeout` passed."""
        if self._http_thread is None:
            raise RuntimeError("OpenAIEndpoint.start() was not called")
        if not self._ready.wait(timeout):
            raise TimeoutError(f"OpenAI endpoint not ready after {timeout} s")
        if self._startup_error is not None or not (self._server and self._server.started):
            raise RuntimeError(f"OpenAI endpoint failed to start: {self._startup_error!r}")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop serving, finish the worker, close the port. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(timeout)
            if self._http_thread.is_alive():
                raise RuntimeError("OpenAI endpoint's HTTP thread did not stop")
        if self._worker_thread is not None:
            self._jobs.put(None)
            self._worker_thread.join(timeout)
            if self._worker_thread.is_alive():
                raise RuntimeError("OpenAI endpoint's generate thread did not stop")
        if self._socket is not None:
            self._socket.close()
        self._http_thread = self._worker_thread = None

    # ------------------------------------------------------------------ generate worker

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while True:
                    nxt = self._jobs.get_nowait()
                    if nxt is None:
                        self._jobs.put(None)  # finish this batch, then stop
                        break
                    batch.append(nxt)
            requests = [r for rs, _ in batch for r in rs]
            try:
                results = self.generate(requests)
            except ValueError:
                # a request the backend refuses: serve the others alone, so that only it gets the 400
                for rs, fut in batch:
                    self._serve_alone(rs, fut)
                continue
            except BaseException as e:  # noqa: BLE001 - delivered to every waiting request
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            start = 0
            for rs, fut in batch:
                fut.set_result(results[start:start + len(rs)])
                start += len(rs)

    def _serve_alone(self, requests: list[TokenRequest], fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(self.generate(requests))
        except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
            fut.set_exception(e)

    async def _run(self, requests: list[TokenRequest]) -> list[list[Generation]]:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((requests, fut))
        try:
            return await asyncio.wrap_future(fut)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        except Exception as e:
            logger.exception("generation failed")
            raise HTTPException(status_code=500, detail=f"generation failed: {e}") from e

    def _requests_for(self, prompts: list[list[int]], *, n: int, temperature: float, seed: Optional[int],
                      max_tokens: int, stops: list[str], stop_token_ids: Sequence[int] = ()) -> list[TokenRequest]:
        stop_seqs = [tuple(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops]
        stop_seqs += [(int(t),) for t in stop_token_ids]
        try:
            sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                      stop_sequences=tuple(dict.fromkeys(s for s in stop_seqs if len(s) > 0)))
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        seed = seed if seed is not None else random.getrandbits(31)
        return [TokenRequest(p, n, sampling, seed, i) for i, p in enumerate(prompts)]

    # ------------------------------------------------------------------ routes

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="marinrl inference")
        app.add_middleware(RequireApiKey, key=self._api_key)

        @app.exception_handler(HTTPException)
        async def openai_style_error(request, exc: HTTPException):
            return openai_error(exc.status_code, str(exc.detail))

        @app.exception_handler(RequestValidationError)
        async def invalid_request(request, exc: RequestValidationError):
            # a body that does not parse (a missing or mistyped field): 400 naming each field, as OpenAI answers
            problems = [f"{'.'.join(str(part) for part in e['loc'] if part != 'body') or 'body'}: {e['msg']}"
                        for e in exc.errors()]
            return openai_error(400, f"invalid request: {'; '.join(problems)}")

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": self.model_name}

        @app.get("/v1/models")
        async def models():
            card = {"id": self.model_name, "object": "model", "owned_by": "marinrl"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len  # vLLM's extension: clients check prompts against it
            return {"object": "list", "data": [card]}

        @app.post(token_endpoint.PATH)
        async def generate(req: token_endpoint.GenerateRequest) -> dict:
            token_endpoint.check(req, self.vocab_size)
            sp = req.sampling_params
            stops = _stop_list(sp.stop)
            max_tokens = sp.max_tokens if sp.max_tokens is not None else self.default_max_tokens
            (request,) = self._requests_for([list(req.token_ids)], n=sp.n, temperature=sp.temperature,
                                            seed=sp.seed, max_tokens=max_tokens, stops=stops,
                                            stop_token_ids=sp.stop_token_ids or ())
            (samples,) = await self._run([request])
            choices = []
            for sample in samples:
                done = _Finished(self.tokenizer, sample, stops)
                steps = sample.weight_steps
                steps = None if steps is None else [int(w) for w in steps[:len(done.tokens)]]
                choices.append((done.tokens, done.logprobs, done.finish_reason, steps))
            return token_endpoint.response_body(req, choices)

        @app.post("/v1/completions")
        async def completions(req: CompletionRequest) -> Completion:
            _refuse_unsupported(req)
            prompts = self._completion_prompts(req.prompt)
            max_tokens = req.max_tokens if req.max_tokens is not None else self.default_max_tokens
            stops = _stop_list(req.stop)
            results = await self._run(self._requests_for(prompts, n=req.n, temperature=req.temperature, seed=req.seed,
                                                         max_tokens=max_tokens, stops=stops))
            choices, n_out = [], 0
            for prompt, samples in zip(prompts, results):
                for sample in samples:
                    done = _Finished(self.tokenizer, sample, stops)
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = Logprobs(
                            tokens=self.tokenizer.convert_ids_to_tokens(done.tokens),
                            token_logprobs=[float(x) for x in done.logprobs],
                        )
                    choices.append(
                        CompletionChoice(
                            index=len(choices), text=done.text, finish_reason=done.finish_reason, logprobs=logprobs,
                            prompt_token_ids=[int(t) for t in prompt], token_ids=done.tokens,
                        )
                    )
                    n_out += len(done.tokens)
            n_in = sum(len(p) for p in prompts)
            return Completion(
                id=f"cmpl-{uuid.uuid4().hex}",
                object="text_completion",
                created=int(time.time()),
                model=self.model_name,
                choices=choices,
                usage=CompletionUsage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out),
            )

        @app.post("/v1/chat/completions")
        async def chat_completions(req: ChatCompletionRequest) -> ChatCompletion:
            _refuse_unsupported(req)
            messages = [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]
            try:
                prompt = chat_prompt_tokens(self.tokenizer, messages)
            except Exception as e:  # a template that rejects the conversation
                raise HTTPException(status_code=400, detail=f"chat template failed: {e}") from e
            max_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
            stops = _stop_list(req.stop)
            (samples,) = await self._run(self._requests_for([prompt], n=req.n, temperature=req.temperature,
                                                            seed=req.seed, max_tokens=max_tokens, stops=stops))
            choices, n_out = [], 0
            for sample in samples:
                done = _Finished(self.tokenizer, sample, stops)
                logprobs = None
                if req.logprobs:
                    content = []
                    for tok, lp in zip(self.tokenizer.convert_ids_to_tokens(done.tokens), done.logprobs):
                        content.append(
                            ChatCompletionTokenLogprob(
                                token=tok, logprob=float(lp), bytes=list(tok.encode("utf-8")), top_logprobs=[]
                            )
                        )
                    logprobs = ChoiceLogprobs(content=content)
                choices.append(
                    ChatChoice(
                        index=len(choices),
                        message=ChatCompletionMessage(role="assistant", content=done.text),
                        finish_reason=done.finish_reason,
                        logprobs=logprobs,
                        token_ids=done.tokens,
                    )
                )
                n_out += len(done.tokens)
            return ChatCompletion(
                prompt_token_ids=prompt,
                id=f"chatcmpl-{uuid.uuid4().hex}",
                object="chat.completion",
                created=int(time.time()),
                model=self.model_name,
                choices=choices,
                usage=CompletionUsage(
                    prompt_tokens=len(prompt), completion_tokens=n_out, total_tokens=len(prompt) + n_out
                ),
            )

        return app

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if len(prompt) == 0:
            raise HTTPException(status_code=400, detail="empty prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        out = []
        for p in prompt:
            out.append(self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p))
        return out


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise HTTPException(status_code=400, detail=f"unsupported message part type {part.get('type')!r}")
        parts.append(part.get("text", ""))
    return "".join(parts)
