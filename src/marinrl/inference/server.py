"""The inference server a RolloutManager owns: the policy's current weights and weight step, the
`InferenceContext` environments call (`generate`), and the OpenAI-compatible endpoint with the token
endpoint beside it (`/inference/v1/generate`, whose tokens carry the weight step that sampled them).

    server = InferenceServer(InferenceServerConfig(serve_http=True), model, tokenizer, weight_step=0).start()
    server.wait_until_ready()
    gens = server.generate(prompts, n=8, sampling=SamplingParams(max_tokens=32), seed=0)
    server.reload(new_model, weight_step=1)     # in place, no recompile
    server.shutdown()                           # no thread or port left behind

`generate` runs the scan sampler (`sampler.py`) by default, or Levanter's engine with
`backend="engine"`; the HTTP endpoint runs `http_backend` (by default the same as `generate`). Both
go through `generate_requests`, the one seam between the endpoint and a sampler, and see the same
weights: `reload` swaps them for both at once.

The endpoint requires an API key on every request but `/health`: `config.api_key`, or a random key
per `start()` when none is configured (`server.api_key`; in-process agents get it with the URL). A
`host` other than loopback needs a configured key: the config refuses it otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import jax
import numpy as np

from marinrl.config.inflight import InflightConfig
from marinrl.config.model import ModelConfig
from marinrl.config.server import InferenceServerConfig
from marinrl.inference import sampler as scan_sampler
from marinrl.inference import sharding
from marinrl.inference.context import Generation, SamplingParams, chat_prompt_tokens, response_text
from marinrl.inference.decode_kernel import resolve_attention
from marinrl.inference.inflight import WeightSwaps
from marinrl.inference.levanter_engine import EngineJob, LevanterEngine, engine_key
from marinrl.inference.openai_api import OpenAIEndpoint, TokenRequest
from marinrl.inference.served_model import (
    cast_floating,
    check_same_structure,
    load_served_model,
    model_context,
    scan_cache_budget,
)
from marinrl.models.policy_model import build_tokenizer

logger = logging.getLogger(__name__)

HTTP_CHUNK_TOKENS = 32
"""The HTTP endpoint's scan sampler decodes in device calls of this many steps, so that the requests queued behind
a long generation are served between its chunks (`generate_queue.py`, docs/inference.md)."""

class InferenceServer:
    """Implements `marinrl.inference.context.InferenceContext`. Thread-safe: `generate` may be called
    from several threads, and `reload` waits for nothing but a running engine call."""

    def __init__(self, config: InferenceServerConfig, model, tokenizer, *, weight_step: int = 0):
        self._http_backend = config.http_backend or config.backend
        if config.backend == "scan" or (config.serve_http and self._http_backend == "scan"):
            scan_sampler.check_supported(model)
        self.config = config
        self._tokenizer = tokenizer
        if config.dtype is not None:  # a no-op for a model built in it (the rollout worker's)
            model = cast_floating(model, config.dtype)
        self._mesh = sharding.rollout_mesh(model, config.model_axis_size)
        self._model = sharding.place(model, self._mesh)
        self._scan_cache_bytes = scan_cache_budget(config.scan_max_cache_bytes, self._mesh)
        self._attention = resolve_attention(config.attention, jax.devices()[0].platform,
                                            model.config.attention_config().head_size,
                                            devices=1 if self._mesh is None else self._mesh.mesh.size)
        self._weight_step = int(weight_step)
        self._lock = threading.Lock()
        self._engine: Optional[LevanterEngine] = None
        self._endpoint: Optional[OpenAIEndpoint] = None
        self._started = False
        self._inflight: Optional[tuple[Callable[[], Any], InflightConfig]] = None
        vocab = model.Vocab.size
        if len(tokenizer) > vocab:
            raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}")
        self._vocab = vocab

    @classmethod
    def from_model_config(
        cls, config: InferenceServerConfig, model_config: ModelConfig, *, weight_step: int = 0
    ) -> InferenceServer:
        """A server for the model and tokenizer `model_config` describes (not started)."""
        return cls(config, load_served_model(model_config, config, dtype=config.dtype), build_tokenizer(model_config),
                   weight_step=weight_step)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> InferenceServer:
        """Build the engine (if anything uses it) and start the endpoint. Returns self."""
        if self._started:
            return self
        http = self.config.serve_http
        if self.config.backend == "engine" or (http and self._http_backend == "engine"):
            engine = self.config.engine
            if engine.compute_dtype is None and self.config.dtype is not None:  # its KV cache in the serving dtype
                engine = dataclasses.replace(engine, compute_dtype=self.config.dtype)
            with sharding.using(self._mesh), self._lock:
                self._engine = LevanterEngine(self._model, self._tokenizer, engine, weight_step=self._weight_step,
                                              lm_head_float32=self.config.lm_head_float32)
        if http:
            backend, min_batch = self._http_backend, self.config.http_min_batch
            self._endpoint = OpenAIEndpoint(
                lambda requests: self.generate_request_steps(requests, backend=backend, min_batch=min_batch,
                                                             stamp_weight_steps=True, chunk_tokens=HTTP_CHUNK_TOKENS),
                self._tokenizer,
                admit=self._admit if backend == "scan" else None,
                host=self.config.host,
                port=self.config.port,
                model_name=self.config.model_name,
                default_max_tokens=self.config.default_max_tokens,
                api_key=self.config.api_key,
                max_model_len=self.config.engine.max_seq_len if backend == "engine" else model_context(self._model),
                context_source="inference.engine.max_seq_len" if backend == "engine" else "the model's seq_len",
                vocab_size=self._vocab,
            ).start()
        self._started = True
        return self

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        """Block until `generate` and the endpoint (if any) serve requests."""
        if not self._started:
            raise RuntimeError("InferenceServer.start() was not called")
        if self._endpoint is not None:
            self._endpoint.wait_until_ready(timeout)

    def shutdown(self) -> None:
        """Stop the endpoint's threads and close its port. Idempotent."""
        if self._endpoint is not None:
            self._endpoint.shutdown()
            self._endpoint = None
        self._engine = None
        self._started = False

    def __enter__(self) -> InferenceServer:
        self.start().wait_until_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ weights

    @property
    def model(self):
        """The served model, its weights on the rollout shardings (a weight-transfer client built from
        it receives new weights there directly)."""
        return self._model

    @property
    def mesh(self) -> Optional[sharding.RolloutMesh]:
        """The rollout mesh (None: one device, no sharding)."""
        return self._mesh

    @property
    def scan_cache_bytes(self) -> int:
        """The scan sampler's cache budget of one call per device (`scan_cache_budget`)."""
        return self._scan_cache_bytes

    @property
    def attention(self) -> str:
        """What the scan sampler's decode steps attend with: `inference.attention` as this device runs it
        (`decode_kernel.resolve_attention`)."""
        return self._attention

    @property
    def weight_step(self) -> int:
        """Weight step of the weights `generate` uses now."""
        return self._weight_step

    def reload(self, model, weight_step: int) -> None:
        """Serve `model` (same architecture, shapes and dtypes: nothing recompiles) as `weight_step`.
        Calls already running finish with the old weights. Leaves not yet on the rollout shardings are
        put there (one device_put each); leaves already there, as the weight transfer delivers them,
        are used as they are."""
        check_same_structure(self._model, model)
        model = sharding.place(model, self._mesh)
        with self._lock:
            self._model = model
            self._weight_step = int(weight_step)
            if self._engine is not None:
                self._engine.set_model(model, self._weight_step)

    @contextlib.contextmanager
    def inflight_updates(self, poll: Callable[[], Any], config: InflightConfig) -> Iterator[None]:
        """While open, `generate` (the scan sampler) swaps in newer weights between chunks of
        `config.swap_every_tokens` decode steps, and at the start of each call: `poll()` returns a
        `WeightUpdate` (`model, weight_step`) newer than the served one, or None. Swapped weights are
        served from then on, as after `reload`; each `Generation` records the step that sampled each
        token (`weight_steps`). The HTTP endpoint never swaps mid-call."""
        if self.config.backend != "scan":
            raise ValueError("in-flight weight updates need inference.backend: scan (the engine backend has no "
                             "chunk boundaries to swap at)")
        if self._inflight is not None:
            raise RuntimeError("in-flight weight updates are already on for this server")
        self._inflight = (poll, config)
        try:
            yield
        finally:
            self._inflight = None

    def _swaps(self, model) -> Optional[WeightSwaps]:
        """The `WeightSwaps` of one `generate` call while `inflight_updates` is open, else None."""
        if self._inflight is None:
            return None
        poll, config = self._inflight

        def newer():
            update = poll()
            if update is None:
                return None
            new_model, step = update
            self.reload(new_model, step)
            with self._lock:
                return self._model, self._weight_step

        with self._lock:
            step = self._weight_step
        return WeightSwaps(newer, model, step, every_tokens=config.swap_every_tokens, kv=config.kv)

    # ------------------------------------------------------------------ InferenceContext

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def url(self) -> str:
        """Base URL of the OpenAI-compatible endpoint (http://127.0.0.1:PORT/v1)."""
        if self._endpoint is None:
            raise RuntimeError("the OpenAI endpoint is not running (serve_http=False or not started)")
        return self._endpoint.url

    @property
    def api_key(self) -> str:
        """The key the OpenAI-compatible endpoint requires (`config.api_key`, or this start's random key)."""
        if self._endpoint is None:
            raise RuntimeError("the OpenAI endpoint is not running (serve_http=False or not started)")
        return self._endpoint.api_key

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, seed: int
    ) -> list[list[Generation]]:
        """`n` samples for each prompt, all prompts in one call; result[i][j] is sample j of prompt i.

        A sample ends at EOS or at the first occurrence, in its own tokens, of any of
        `sampling.stop_sequences` (finish_reason "stop", the stopping tokens included), or after
        `sampling.max_tokens` tokens (finish_reason "length"). Same seed, same samples."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self.generate_requests([TokenRequest(p, n, sampling, seed, i) for i, p in enumerate(prompts)],
                                      inflight=True)

    def generate_dry(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, seed: int
    ) -> list[list[Generation]]:
        """What `generate` returns for these arguments, but every generation empty: the scan sampler
        compiles (or reuses) the program `generate` would run for these shapes and runs only the
        prompts' prefill. With the engine backend nothing runs. For warming up the sampler before the
        policy's weights arrive (`marinrl/rollout/warmup.py`)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        requests = [TokenRequest(p, n, sampling, seed, i) for i, p in enumerate(prompts)]
        if self.config.backend == "scan" and requests:
            self.generate_requests(requests, dry_run=True)
        empty = Generation(np.zeros((0,), np.int32), np.zeros((0,), np.float32), "length")
        return [[empty] * n for _ in prompts]

    def generate_requests(self, requests: Sequence[TokenRequest], **kwargs) -> list[list[Generation]]:
        """`generate_request_steps` run to the end: the samples of each request, in order."""
        steps = self.generate_request_steps(requests, **kwargs)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def generate_request_steps(
        self, requests: Sequence[TokenRequest], *, backend: Optional[str] = None, min_batch: int = 1,
        dry_run: bool = False, inflight: bool = False, stamp_weight_steps: bool = False,
        chunk_tokens: Optional[int] = None,
    ) -> Generator[None, None, list[list[Generation]]]:
        """Samples of each request, in order, through `backend` (default: `config.backend`), as a generator
        that yields between device calls and returns them. Requests with equal sampling settings share one
        device call; sample j of a request depends only on (its seed, its index, j), its prompt and the
        weights. ValueError names a bad request. The scan sampler pads a device call to at least `min_batch`
        prompts (fewer compiled shapes) and, with `chunk_tokens`, decodes in calls of that many steps
        (`sampler.sample_steps`: the HTTP endpoint serves other requests between them).
        `stamp_weight_steps`: every Generation's `weight_steps` is filled (the step of the weights that
        sampled each token), never None, as the HTTP endpoint reports it."""
        if not self._started:
            raise RuntimeError("InferenceServer.start() was not called")
        requests = [
            dataclasses.replace(r, prompt=self._check_prompt(k, r.prompt)) for k, r in enumerate(requests)
        ]
        for k, r in enumerate(requests):
            if r.n < 1:
                raise ValueError(f"request {k}: n must be >= 1, got {r.n}")
        if not requests:
            return []
        if (backend or self.config.backend) == "engine":
            return self._generate_engine(requests, stamp_weight_steps)
        with self._lock:
            model, step = self._model, self._weight_step
        swaps = self._swaps(model) if inflight and not dry_run else None  # `inflight`: `generate`, not HTTP
        by_settings: dict = {}
        for k, r in enumerate(requests):
            by_settings.setdefault((r.n, r.sampling), []).append(k)
        out: list = [None] * len(requests)
        for (n, sampling), ks in by_settings.items():
            rows = yield from self._generate_scan(model, [requests[k] for k in ks], n, sampling, min_batch, dry_run,
                                                  swaps, chunk_tokens)
            for k, row in zip(ks, rows):
                out[k] = row
        if stamp_weight_steps:
            out = [[_stamped(g, step) for g in row] for row in out]
        return out

    def _admit(self, requests: Sequence[TokenRequest]) -> None:
        """ValueError, before any work, for a request whose samples of one prompt would not fit one device call's
        KV cache budget (the scan sampler splits a call by prompts, never a prompt's `n` samples)."""
        budget = self._scan_cache_bytes
        mesh = None if self._mesh is None else self._mesh.mesh
        for r in requests:
            def cache(n: int, r=r) -> float:
                return scan_sampler.call_plan(self._model, 1, n=n, prompt_tokens=len(r.prompt),
                                              max_tokens=r.sampling.max_tokens, max_cache_bytes=budget,
                                              mesh=mesh).per_device_cache_bytes
            need = cache(r.n)
            if need > budget:
                per_sample = max(cache(2) - cache(1), 1.0)
                most = max(0, int((budget - cache(1)) // per_sample) + 1)
                raise ValueError(f"n={r.n} samples of up to {len(r.prompt) + r.sampling.max_tokens} tokens need "
                                 f"{need / 2**30:.2f} GiB of KV cache a device, over one call's budget of "
                                 f"{budget / 2**30:.2f} GiB (inference.scan_max_cache_bytes): ask for n <= {most} "
                                 "or fewer max_tokens")

    def _stops(self, sampling: SamplingParams) -> tuple[tuple[int, ...], ...]:
        eos = self._tokenizer.eos_token_id
        stops = ((eos,),) if eos is not None else ()
        return stops + tuple(tuple(int(t) for t in s) for s in sampling.stop_sequences)

    def _check_prompt(self, i: int, prompt) -> list[int]:
        p = [int(t) for t in np.asarray(prompt).reshape(-1).tolist()]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {self._vocab})")
        return p

    def _adapter_args(self, requests) -> dict:
        """The sampler's `adapters` and `adapter_index` for `requests`: none here (a plain model); a server of one
        base and several adapters (rollout/shared_base.py) gives its stack and each request's slot."""
        return {}

    def _generate_scan(self, model, requests, n, sampling, min_batch, dry_run=False, swaps=None, chunk_tokens=None):
        out = yield from scan_sampler.sample_steps(
            model,
            [r.prompt for r in requests],
            n=n,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            chunk_tokens=chunk_tokens,
            max_tokens=sampling.max_tokens,
            stop_sequences=self._stops(sampling),
            seed=0,
            max_cache_bytes=self._scan_cache_bytes,
            prompt_keys=[(r.seed, r.index) for r in requests],
            min_prompts=min_batch,
            mesh=None if self._mesh is None else self._mesh.mesh,
            dry_run=dry_run,
            swaps=swaps,
            lm_head_float32=self.config.lm_head_float32,
            attention=self._attention,
            **self._adapter_args(requests),
        )
        result = []
        for i in range(len(requests)):
            row = []
            for j in range(n):
                r = i * n + j
                k = int(out.lengths[r])
                row.append(
                    Generation(
                        tokens=out.tokens[r, :k].copy(),
                        logprobs=out.logprobs[r, :k].copy(),
                        finish_reason="stop" if out.stopped[r] else "length",
                        weight_steps=None if out.weight_steps is None else out.weight_steps[r, :k].copy(),
                    )
                )
            result.append(row)
        return result

    def _generate_engine(self, requests, stamp_weight_steps: bool = False):
        if self._engine is None:
            raise RuntimeError("the Levanter engine is not built (backend and http_backend are 'scan')")
        if any(r.sampling.filtered for r in requests):
            raise ValueError("top_k, top_p and min_p need the scan sampler: the engine backend samples from the whole "
                             "distribution (serve with inference.backend: scan, or leave them at 0, 1 and 0)")
        jobs = [
            EngineJob(r.prompt, r.n, r.sampling.max_tokens, r.sampling.temperature, engine_key(r.seed, r.index),
                      self._stops(r.sampling))
            for r in requests
        ]
        return [
            [
                Generation(
                    tokens=np.asarray(s.tokens, dtype=np.int32),
                    logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    finish_reason="stop" if s.stopped else "length",
                    weight_steps=(np.full(len(s.tokens), s.weight_step, np.int64)
                                  if stamp_weight_steps and s.weight_step is not None else None),
                )
                for s in samples
            ]
            for samples in self._engine_generate(jobs)
        ]

    def _engine_generate(self, jobs):
        with sharding.using(self._mesh):
            return self._engine.generate(jobs)

    # ------------------------------------------------------------------ chat helpers

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Prompt tokens of a conversation, ending with the opening of an assistant turn."""
        return chat_prompt_tokens(self._tokenizer, messages)

    def generate_chat(
        self, conversations: Sequence[Sequence[dict]], n: int, sampling: SamplingParams, seed: int
    ) -> tuple[list[list[int]], list[list[Generation]]]:
        """`generate` on conversations: returns (prompt tokens of each, its generations)."""
        prompts = [self.chat_prompt(c) for c in conversations]
        return prompts, self.generate(prompts, n, sampling, seed)

    def text(self, generation: Generation) -> str:
        """The text of a generation, special tokens left out."""
        return response_text(self._tokenizer, generation)


def _stamped(generation: Generation, step: int) -> Generation:
    """`generation` with `weight_steps` filled: `step` on every token when it has none (sampled by the
    weights the call began with)."""
    if generation.weight_steps is not None:
        return generation
    return dataclasses.replace(generation, weight_steps=np.full(len(generation.tokens), step, np.int64))
