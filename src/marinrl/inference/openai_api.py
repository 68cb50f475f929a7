"""The OpenAI-compatible HTTP endpoint (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`), for environments and evaluators that speak that protocol, and the token endpoint beside it
(`/inference/v1/generate`, vLLM's token-in/token-out route: `token_endpoint.py`).

The endpoint needs one thing from the server behind it: a function that generates for token prompts,
`generate(list[TokenRequest]) -> list[list[Generation]]` (`InferenceServer.generate_requests`, over
the scan sampler or Levanter's engine). This module is the server's lifecycle and its routes; what a route
accepts and refuses is `openai_requests.py`, what it answers (token ids beside the text, vLLM's convention)
`openai_responses.py`, and the thread that batches queued requests into one `generate` call
`generate_queue.py`.

Ours rather than Levanter's `InferenceServer`, whose `finish_reason` is always "stop", which merges
several `stop` strings into one sequence and ignores `top_p`. Here each stop string works on its own and
`finish_reason` says what ended a choice (`openai_responses.py`); unsupported options are refused with 400,
never ignored (`openai_requests.py`).

Every request but `GET /health` must carry the endpoint's API key (`api_auth`: 401 without it).

Lifecycle: `start()` binds the port and starts the threads, `wait_until_ready()` blocks until uvicorn
serves, `shutdown()` stops both threads and closes the port.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
from typing import Optional, Sequence

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from openai.types import Completion
from openai.types.chat import ChatCompletion

from marinrl.config.checks import check_api_key
from marinrl.inference import openai_responses, token_endpoint
from marinrl.inference.api_auth import RequireApiKey, new_api_key, openai_error
from marinrl.inference.context import Generation, SamplingParams, chat_prompt_tokens
from marinrl.inference.generate_queue import GenerateFn, GenerateQueue, TokenRequest
from marinrl.inference.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    completion_prompts,
    invalid_body_message,
    refuse_unsupported,
    stop_list,
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
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
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

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop serving, finish the worker, close the port. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(timeout)
            if self._http_thread.is_alive():
                raise RuntimeError("OpenAI endpoint's HTTP thread did not stop")
        self._queue.stop(timeout)
        if self._socket is not None:
            self._socket.close()
        self._http_thread = None

    # ------------------------------------------------------------------ generating

    async def _run(self, requests: list[TokenRequest]) -> list[list[Generation]]:
        try:
            return await asyncio.wrap_future(self._queue.submit(requests))
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
            return openai_error(400, invalid_body_message(exc))

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": self.model_name}

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
        token_endpoint.check(req, self.vocab_size)
        sp = req.sampling_params
        stops = stop_list(sp.stop)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.default_max_tokens
        (request,) = self._requests_for([list(req.token_ids)], n=sp.n, temperature=sp.temperature, seed=sp.seed,
                                        max_tokens=max_tokens, stops=stops, stop_token_ids=sp.stop_token_ids or ())
        (samples,) = await self._run([request])
        return token_endpoint.response_body(req, openai_responses.token_choices(self.tokenizer, samples, stops))

    async def _completions(self, req: CompletionRequest) -> Completion:
        refuse_unsupported(req)
        prompts = completion_prompts(self.tokenizer, req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.default_max_tokens
        stops = stop_list(req.stop)
        results = await self._run(self._requests_for(prompts, n=req.n, temperature=req.temperature, seed=req.seed,
                                                     max_tokens=max_tokens, stops=stops))
        return openai_responses.completion(self.tokenizer, self.model_name, prompts, results, stops,
                                           logprobs=req.logprobs is not None)

    async def _chat_completions(self, req: ChatCompletionRequest) -> ChatCompletion:
        refuse_unsupported(req)
        try:
            prompt = chat_prompt_tokens(self.tokenizer, chat_messages(req))
        except Exception as e:  # a template that rejects the conversation
            raise HTTPException(status_code=400, detail=f"chat template failed: {e}") from e
        max_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        stops = stop_list(req.stop)
        (samples,) = await self._run(self._requests_for([prompt], n=req.n, temperature=req.temperature,
                                                        seed=req.seed, max_tokens=max_tokens, stops=stops))
        return openai_responses.chat_completion(self.tokenizer, self.model_name, prompt, samples, stops,
                                                logprobs=req.logprobs)
