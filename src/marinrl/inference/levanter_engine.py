"""Levanter's `InferenceEngine` behind a small, correct surface: build it with CPU or accelerator
defaults, generate for any number of prompts, swap weights without recompiling.

What this adds to the engine, and why:
- Chunking. One `engine.generate` call must admit all its sequences in its first prefill: the engine
  stops its decode loop after `max_seq_len / max_rounds` outer rounds, so sequences admitted later
  come back silently short. Calls are therefore split so that each chunk fits the engine's slots,
  pages and prefill buffer, and a sequence that still comes back short raises.
- Stop sequences. The engine would match a multi-token stop sequence across the prompt/response
  boundary, and it has a fixed stop capacity. It gets EOS and single-token stops only; multi-token
  ones are matched here, in the response only, truncating after the first match.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Optional, Sequence

import haliax as hax
import jax
import jax.numpy as jnp
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams

from marinrl.config.server import EngineConfig

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def resolved_engine_config(config: EngineConfig) -> InferenceEngineConfig:
    """Levanter's engine config for `config` on this platform (its `None`s filled in)."""
    cpu = on_cpu()
    page_size = config.page_size or (64 if cpu else 128)
    pages_per_seq = -(-config.max_seq_len // page_size)
    max_pages = config.max_pages
    if max_pages is None and cpu:
        max_pages = config.max_seqs * pages_per_seq
    dtype = jnp.dtype(config.compute_dtype) if config.compute_dtype else (jnp.float32 if cpu else jnp.bfloat16)
    return InferenceEngineConfig(
        max_seq_len=config.max_seq_len,
        max_seqs=config.max_seqs,
        page_size=page_size,
        max_pages=max_pages,
        hbm_utilization=config.hbm_utilization,
        compute_dtype=dtype,
        max_rounds=config.max_rounds,
        max_stop_seqs=config.max_stop_tokens,
        max_stop_tokens=1,
        max_seqs_in_prefill=config.max_seqs,
        max_prefill_size=config.max_prefill_tokens,
        max_queued_tokens=max(512, config.max_seqs),
        enable_logprobs=True,
    )


@dataclasses.dataclass(frozen=True)
class EngineJob:
    """One prompt's request: `n` samples with their own stop rules."""

    prompt: Sequence[int]
    n: int
    max_tokens: int
    temperature: float
    key: jax.Array
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a sample (EOS must be listed here too)."""


@dataclasses.dataclass(frozen=True)
class EngineSample:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    weight_step: Optional[int] = None
    """The weight step of the weights that sampled it (as given to the engine; None: not given)."""


def find_stop(tokens: Sequence[int], stop_sequences: Sequence[Sequence[int]]) -> Optional[int]:
    """Length of the shortest prefix of `tokens` that ends with one of `stop_sequences`, or None."""
    for end in range(1, len(tokens) + 1):
        for s in stop_sequences:
            if len(s) <= end and tuple(tokens[end - len(s):end]) == tuple(s):
                return end
    return None


class LevanterEngine:
    """A Levanter `InferenceEngine` that takes any number of jobs and stop sequences of any length.

    Thread-safe: one engine call runs at a time."""

    def __init__(self, model, tokenizer, config: EngineConfig, weight_step: Optional[int] = None):
        self.config = config
        self.weight_step = weight_step
        """The weight step of the served weights, stamped on each sample (`set_model` changes both)."""
        self.engine_config = resolved_engine_config(config)
        self._lock = threading.Lock()
        self.engine = InferenceEngine.from_model_with_config(model, tokenizer, self.engine_config)
        cfg = self.engine.config
        self._max_pages = int(cfg.max_pages)
        self._page_size = int(cfg.page_size)

    def set_model(self, model, weight_step: Optional[int] = None) -> None:
        """Swap the weights (same shapes and dtypes: no recompile), as `weight_step`. Waits for a running call."""
        with self._lock:
            self.engine.model = model
            self.weight_step = weight_step

    def validate(self, job: EngineJob) -> None:
        """Raise ValueError, saying why, if `job` cannot fit the engine."""
        if len(job.prompt) < 1:
            raise ValueError("empty prompt")
        need = len(job.prompt) + job.max_tokens
        if need > self.config.max_seq_len:
            raise ValueError(
                f"prompt of {len(job.prompt)} tokens + max_tokens {job.max_tokens} = {need} exceeds the "
                f"engine's max_seq_len {self.config.max_seq_len}"
            )
        if job.n > self.config.max_seqs:
            raise ValueError(f"n={job.n} exceeds the engine's max_seqs {self.config.max_seqs}")
        if len(job.prompt) > self.config.max_prefill_tokens:
            raise ValueError(
                f"prompt of {len(job.prompt)} tokens exceeds max_prefill_tokens {self.config.max_prefill_tokens}"
            )
        if self._pages(job) > self._max_pages:
            raise ValueError(f"a request needs {self._pages(job)} KV pages, the engine has {self._max_pages}")

    def generate(self, jobs: Sequence[EngineJob]) -> list[list[EngineSample]]:
        """Samples for each job, in order. Raises ValueError for a job that cannot fit the engine."""
        for job in jobs:
            self.validate(job)
        results: list[list[EngineSample]] = []
        for chunk in self._chunks(jobs):
            with self._lock:
                results.extend(self._generate_chunk(chunk, self.weight_step))
        return results

    def _pages(self, job: EngineJob) -> int:
        return job.n * -(-(len(job.prompt) + job.max_tokens) // self._page_size)

    def _chunks(self, jobs: Sequence[EngineJob]):
        chunk: list[EngineJob] = []
        rows = tokens = pages = 0
        for job in jobs:
            fits = (
                rows + job.n <= self.config.max_seqs
                and tokens + len(job.prompt) <= self.config.max_prefill_tokens
                and pages + self._pages(job) <= self._max_pages
            )
            if chunk and not fits:
                yield chunk
                chunk, rows, tokens, pages = [], 0, 0, 0
            chunk.append(job)
            rows, tokens, pages = rows + job.n, tokens + len(job.prompt), pages + self._pages(job)
        if chunk:
            yield chunk

    def _generate_chunk(self, jobs: Sequence[EngineJob], weight_step: Optional[int]) -> list[list[EngineSample]]:
        requests = []
        for i, job in enumerate(jobs):
            single = [s[0] for s in job.stop_sequences if len(s) == 1][: self.config.max_stop_tokens]
            stop_tokens = None
            if single:
                stop_tokens = hax.named(jnp.asarray([[t] for t in single], dtype=jnp.int32), ("stop_seq", "position"))
            params = SeqDecodingParams(
                max_num_tokens=jnp.asarray(len(job.prompt) + job.max_tokens, dtype=jnp.int32),
                stop_tokens=stop_tokens,
                temperature=jnp.asarray(job.temperature, dtype=jnp.float32),
                key=job.key,
            )
            requests.append(
                Request(
                    prompt_tokens=[int(t) for t in job.prompt],
                    request_id=i,
                    decode_params=params,
                    n_generations=job.n,
                    enable_logprobs=True,
                )
            )
        result = self.engine.generate(requests)
        out: list[list[EngineSample]] = []
        row = 0
        for job in jobs:
            samples = []
            for _ in range(job.n):
                tokens, logprobs = list(result.tokens[row]), list(result.logprobs[row])
                row += 1
                end = find_stop(tokens, job.stop_sequences)
                if end is not None:
                    samples.append(EngineSample(tokens[:end], logprobs[:end], True, weight_step))
                elif len(tokens) >= job.max_tokens:
                    samples.append(EngineSample(tokens[: job.max_tokens], logprobs[: job.max_tokens], False,
                                                weight_step))
                else:
                    raise RuntimeError(
                        f"Levanter engine returned {len(tokens)} of {job.max_tokens} tokens with no stop: "
                        "a sequence was dropped (engine sizing bug)"
                    )
            out.append(samples)
        return out


def engine_key(seed: int, prompt_index: int) -> jax.Array:
    """PRNG key of prompt `prompt_index` of a call with `seed` (the engine derives one per sample)."""
    return jax.random.fold_in(jax.random.PRNGKey(seed % (1 << 32)), prompt_index)
