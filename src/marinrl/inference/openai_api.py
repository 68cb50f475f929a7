"""The OpenAI-compatible HTTP endpoint (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`), for environments and evaluators that speak that protocol, and the token endpoint beside it
(`/inference/v1/generate`, vLLM's token-in/token-out route: `token_endpoint.py`).

The endpoint needs one thing from the server behind it: a function that generates for token prompts,
`generate(list[TokenRequest])`, a generator that yields between device calls and returns
`list[list[Generation]]` (`InferenceServer.generate_request_steps`, over the scan sampler or Levanter's
engine). This module is the server's lifecycle and its routes; what a route accepts and refuses (the model,
options, token budgets against the model's context, rows) is `openai_requests.py`, what it answers (token ids
beside the text, vLLM's convention) `openai_responses.py`, and the thread that serves queued requests in rounds
of bounded device calls, so that no request waits for another's whole generation, `generate_queue.py`.

Ours rather than Levanter's `InferenceServer`, whose `finish_reason` is always "stop", which merges
several `stop` strings into one sequence and ignores `top_p`. Here each stop string works on its own and
`finish_reason` says what ended a choice (`openai_responses.py`); unsupported options are refused with 400,
never ignored (`openai_requests.py`).

Every request but `GET /health` must carry the endpoint's API key (`api_auth`: 401 without it).

Lifecycle: `start()` binds the port and starts the threads, `wait_until_ready()` blocks until uvicorn
serves, `shutdown()` stops the generate thread (the requests in hand get 503), then uvicorn, and closes the port.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
from typing import Callable, Optional, Sequence

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from openai.types import Completion
from openai.types.chat import ChatCompletion

from marinrl.config.checks import check_api_key
from marinrl.inference import openai_responses, token_endpoint
from marinrl.inference.api_auth import RequireApiKey, new_api_key, openai_error
from marinrl.inference.context import Generation, SamplingParams, chat_prompt_tokens
from marinrl.inference.generate_queue import EndpointStopping, GenerateFn, GenerateQueue, TokenRequest
from marinrl.inference.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_rows,
    completion_prompts,
    filters,
    invalid_body_message,
    refuse_unsupported,
    stop_list,
    token_budget,
)

__all__ = ["GenerateFn", "OpenAIEndpoint", "TokenRequest"]

logger = logging.getLogger(__name__)


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
        context_source: str = "max_model_len",
        vocab_size: Optional[int] = None,
        admit: Optional[Callable[[Sequence[TokenRequest]], None]] = None,
    ):
        """`generate`: a generator per batch of requests (`generate_queue.GenerateFn`); `max_model_len`: the
        longest prompt + generation it serves (None: no limit known), which `/v1/models` reports as vLLM does
        and every request's `max_tokens` is checked against (`context_source` names the setting in messages);
        `vocab_size`: the model's (default: the tokenizer's length), against which the token endpoint checks
        token ids; `admit`: raises ValueError (a 400) for requests too large to serve, before they queue."""
        self._api_key = new_api_key() if api_key is None else check_api_key(api_key)
        self.max_model_len = max_model_len
        self.context_source = context_source
        self._admit = admit
        self.vocab_size = len(tokenizer) if vocab_size is None else vocab_size
        self.generate = generate
        self.tokenizer = tokenizer
        self.host = host
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self._requested_port = port
        self._queue = GenerateQueue(generate)
        self._ready = threading.Event()
        self._startup_error: Optional[BaseException] = None
        self._socket: Optional[socket.socket] = None
        self._server: Optional[uvicorn.Server] = None
        self._http_thread: Optional[threading.Thread] = None
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
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self._server = _Server(config, on_started=self._ready.set)
        self._queue.start()
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

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop generating (requests in hand are answered 503 after the device call in progress), stop serving,
        close the port. Idempotent."""
        if not self._queue.stop(timeout):  # a daemon: it ends with the process (`marinrl serve` says so)
            logger.debug("OpenAI endpoint: the generate thread is still in a device call after %.0f s", timeout)
        if self._server is not None:
            self._server.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(timeout)
            if self._http_thread.is_alive():
                raise RuntimeError("OpenAI endpoint's HTTP thread did not stop")
        if self._socket is not None:
            self._socket.close()
        self._http_thread = None

    # ------------------------------------------------------------------ generating

    async def _run(self, requests: list[TokenRequest]) -> list[list[Generation]]:
        if self._admit is not None:
            try:
                self._admit(requests)
            except ValueError as e:
                raise HTTPException(status_code=400, detail=str(e)) from e
        try:
            return await asyncio.wrap_future(self._queue.submit(requests))
        except EndpointStopping as e:
            raise HTTPException(status_code=503, detail=str(e)) from e
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        except Exception as e:
            logger.exception("generation failed")
            raise HTTPException(status_code=500, detail=f"generation failed: {e}") from e

    def _requests_for(self, prompts: list[list[int]], *, n: int, temperature: float, seed: Optional[int],
                      max_tokens: list[int], stops: list[str], stop_token_ids: Sequence[int] = (),
                      top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[TokenRequest]:
        stop_seqs = [tuple(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops]
        stop_seqs += [(int(t),) for t in stop_token_ids]
        stop_seqs = tuple(dict.fromkeys(s for s in stop_seqs if len(s) > 0))
        seed = seed if seed is not None else random.getrandbits(31)
        try:
            return [TokenRequest(p, n, SamplingParams(temperature=temperature, max_tokens=budget, top_k=top_k,
                                                      top_p=top_p, min_p=min_p, stop_sequences=stop_seqs), seed, i)
                    for i, (p, budget) in enumerate(zip(prompts, max_tokens))]
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e

    def _budget(self, given: Optional[int], field: str, prompt: Sequence[int]) -> int:
        return token_budget(given, field, len(prompt), self.default_max_tokens, self.max_model_len,
                            self.context_source)

    # ------------------------------------------------------------------ routes

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="marinrl inference")
        app.add_middleware(RequireApiKey, key=self._api_key)

        @app.exception_handler(HTTPException)
        async def openai_style_error(request, exc: HTTPException):
            return openai_error(exc.status_code, str(exc.detail))

        @app.exception_handler(RequestValidationError)
        async def invalid_request(request, exc: RequestValidationError):
            return openai_error(400, invalid_body_message(exc))

        @app.get("/health")
        async def health():
            """ok while the generate thread runs; what it has in hand (requests, rounds served)."""
            if not self._queue.running:
                return openai_error(503, "the endpoint's generate thread is not running")
            return {"status": "ok", "model": self.model_name, "requests_in_hand": self._queue.in_hand,
                    "rounds": self._queue.rounds}

        app.get("/v1/models")(self._models)
        app.post(token_endpoint.PATH)(self._generate)
        app.post("/v1/completions")(self._completions)
        app.post("/v1/chat/completions")(self._chat_completions)
        return app

    async def _models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "owned_by": "marinrl"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len  # vLLM's extension: clients check prompts against it
        return {"object": "list", "data": [card]}

    async def _generate(self, req: token_endpoint.GenerateRequest) -> dict:
        token_endpoint.check(req, self.vocab_size, self.model_name)
        sp = req.sampling_params
        stops = stop_list(sp.stop)
        check_rows(sp.n, 1, "sampling_params.n")
        budget = self._budget(sp.max_tokens, "sampling_params.max_tokens", req.token_ids)
        (request,) = self._requests_for([list(req.token_ids)], n=sp.n, temperature=sp.temperature, seed=sp.seed,
                                        max_tokens=[budget], stops=stops, stop_token_ids=sp.stop_token_ids or (),
                                        **token_endpoint.filters(sp))
        (samples,) = await self._run([request])
        return token_endpoint.response_body(req, openai_responses.token_choices(self.tokenizer, samples, stops))

    async def _completions(self, req: CompletionRequest) -> Completion:
        refuse_unsupported(req, self.model_name)
        prompts = completion_prompts(self.tokenizer, req.prompt)
        check_rows(req.n, len(prompts))
        budgets = [self._budget(req.max_tokens, "max_tokens", p) for p in prompts]
        stops = stop_list(req.stop)
        results = await self._run(self._requests_for(prompts, n=req.n, temperature=req.temperature, seed=req.seed,
                                                     max_tokens=budgets, stops=stops, **filters(req)))
        return openai_responses.completion(self.tokenizer, self.model_name, prompts, results, stops,
                                           logprobs=req.logprobs is not None)

    async def _chat_completions(self, req: ChatCompletionRequest) -> ChatCompletion:
        refuse_unsupported(req, self.model_name)
        try:
            prompt = chat_prompt_tokens(self.tokenizer, chat_messages(req))
        except Exception as e:  # a template that rejects the conversation
            raise HTTPException(status_code=400, detail=f"chat template failed: {e}") from e
        check_rows(req.n, 1)
        given, field = req.max_completion_tokens, "max_completion_tokens"
        if given is None:
            given, field = req.max_tokens, "max_tokens"
        budget = self._budget(given, field, prompt)
        stops = stop_list(req.stop)
        (samples,) = await self._run(self._requests_for([prompt], n=req.n, temperature=req.temperature,
                                                        seed=req.seed, max_tokens=[budget], stops=stops,
                                                        **filters(req)))
        return openai_responses.chat_completion(self.tokenizer, self.model_name, prompt, samples, stops,
                                                logprobs=req.logprobs)
