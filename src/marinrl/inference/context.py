"""What environments call: token-in/token-out generation, plus chat-template helpers on top.

Environments depend on this protocol only, never on the engine behind it, so the same environment
runs against the in-process Levanter engine and (for agent code) the OpenAI-compatible endpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Protocol, Sequence

import numpy as np

from marinrl.config.checks import require_at_least


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn. `temperature == 0` is greedy. The filters (`top_k`, `top_p`, `min_p`) need the
    scan sampler; the logprobs are those of the filtered distribution sampled from."""

    @property
    def filtered(self) -> bool:
        """Whether any filter restricts the distribution."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    temperature: float = 1.0
    max_tokens: int = 32
    """Budget of new tokens for this turn."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end the turn (included in the response); EOS always stops."""
    top_k: int = 0
    """Sample among the `top_k` likeliest tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the likeliest tokens whose probabilities sum to `top_p` (1: all)."""
    min_p: float = 0.0
    """Sample among the tokens at least `min_p` times as likely as the likeliest (0: all)."""

    def __post_init__(self):
        require_at_least(self, 0, "temperature")
        require_at_least(self, 1, "max_tokens")
        require_at_least(self, 0, "top_k")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        for s in self.stop_sequences:
            if len(s) == 0:
                raise ValueError("SamplingParams.stop_sequences holds an empty sequence")


@dataclasses.dataclass(frozen=True)
class Generation:
    """One sampled continuation of one prompt."""

    tokens: np.ndarray
    """int32 new tokens, including the EOS or stop sequence that ended the turn."""
    logprobs: np.ndarray
    """float32 log μ(token) of each new token, at the sampling temperature."""
    finish_reason: Literal["stop", "length"]
    weight_steps: Optional[np.ndarray] = None
    """int64 weight step of the weights that sampled each new token, when the server swapped weights in
    flight (`InferenceServer.inflight_updates`) or the caller asked for them (`stamp_weight_steps`, as the
    HTTP endpoint does); None: all by the weights the call began with."""

    def truncated(self, k: int) -> Generation:
        """The first `k` tokens, finish_reason "length" (a prefix's logprobs do not depend on what follows)."""
        steps = None if self.weight_steps is None else np.asarray(self.weight_steps)[:k]
        return Generation(np.asarray(self.tokens)[:k], np.asarray(self.logprobs)[:k], "length", steps)


class InferenceContext(Protocol):
    """The inference surface an environment sees. A context that also serves the OpenAI-compatible
    endpoint has a `url` attribute (its base URL, `http://host:port/v1`) and an `api_key` attribute (the
    key its requests must send); environments that speak that protocol read them with `endpoint_url(ctx)`
    and `endpoint_api_key(ctx)`."""

    @property
    def tokenizer(self):  # a transformers PreTrainedTokenizerBase
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, seed: int
    ) -> list[list[Generation]]:
        """`n` samples for each prompt, all prompts in one engine call; result[i][j] is sample j of prompt i."""
        ...


def endpoint_url(ctx) -> str:
    """The base URL of `ctx`'s OpenAI-compatible endpoint; ValueError, saying how to get one, if it has none."""
    try:
        url = getattr(ctx, "url", None)
    except RuntimeError as e:  # InferenceServer.url when the endpoint is not running
        raise ValueError(f"the inference context has no OpenAI endpoint: {e}; set "
                         "InferenceServerConfig.serve_http=True (YAML: inference.serve_http: true)") from e
    if not url:
        raise ValueError(f"the inference context {type(ctx).__name__} has no `url` (no OpenAI endpoint); "
                         "environments over HTTP need an InferenceServer with serve_http=True")
    return str(url)


def endpoint_api_key(ctx) -> str:
    """The API key `ctx`'s endpoint requires (its `api_key`, `InferenceServer.api_key`); a placeholder
    for a context without one (an endpoint that checks no key), since OpenAI clients need some key."""
    key = getattr(ctx, "api_key", None)
    return str(key) if key else "none"


# ---------------------------------------------------------------- chat-template helpers (for any context)


def chat_prompt_tokens(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation (a list of {"role", "content"}) through the tokenizer's chat template,
    ending with the opening of an assistant turn when `add_generation_prompt`."""
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def stop_sequences(tokenizer, strings: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token-id stop sequences for `strings`, as `SamplingParams.stop_sequences` wants them."""
    out = []
    for s in strings:
        ids = tuple(int(t) for t in tokenizer.encode(s, add_special_tokens=False))
        if not ids:
            raise ValueError(f"stop string {s!r} encodes to no tokens")
        out.append(ids)
    return tuple(out)


def response_text(tokenizer, generation: Generation) -> str:
    """The text of a generation, special tokens (EOS, role markers) left out."""
    return tokenizer.decode(generation.tokens.tolist(), skip_special_tokens=True)


def lesson_sampling(lesson, tokenizer, mode: Literal["train", "eval"] = "train") -> SamplingParams:
    """`SamplingParams` of a `LessonConfig` for training or evaluation (its stop strings encoded by `tokenizer`)."""
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    return SamplingParams(temperature=lesson.temperature if mode == "train" else lesson.eval_temperature,
                          max_tokens=lesson.max_tokens,
                          stop_sequences=stop_sequences(tokenizer, lesson.stop) if lesson.stop else ())


def policy_context(ctx, policy: str):
    """The context that samples `policy`'s turns: its model's server behind a `PolicyRouter`
    (rollout/policy_router.py), else `ctx` itself (one model serves every policy)."""
    route = getattr(ctx, "for_policy", None)
    return ctx if route is None else route(policy)
