"""The token endpoint, `POST /inference/v1/generate`: token ids in, token ids and per-token logprobs out,
in vLLM's shapes, so that a client that renders chat turns to tokens itself (verifiers' `TrainClient`,
through `renderers.client.generate`) trains on exactly the tokens we sampled. `OpenAIEndpoint` serves it
beside the OpenAI routes, behind the same API key; this module is its request, its checks and its answer.

Request (vLLM's `GenerateRequest`, the part we serve):

    {"model": "marinrl-policy", "token_ids": [1, 2, 3],
     "sampling_params": {"max_tokens": 64, "temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.0, "n": 1,
                         "seed": 0, "stop": ["\\n\\n"], "stop_token_ids": [257], "logprobs": 1}}

Answer:

    {"request_id": "gen-…", "prompt_token_ids": [1, 2, 3],
     "choices": [{"index": 0, "token_ids": [...], "finish_reason": "stop" | "length",
                  "logprobs": {"content": [{"token": "token_id:42", "logprob": -1.3, "top_logprobs": []}, …]},
                  "weight_steps": [7, 7, …]}],
     "usage": {"prompt_tokens": 3, "completion_tokens": …, "total_tokens": …}}

`token_ids` are the sampled tokens, the EOS or stop token that ended the turn included; `logprobs.content[k]`
is token k's sampler logprob (`token` names its id as vLLM's `return_tokens_as_token_ids` does; no
alternatives: `top_logprobs` is empty), present when `sampling_params.logprobs` is 0 or 1; `weight_steps[k]`
is the weight step that sampled token k (ours; vLLM clients ignore it). A request without `max_tokens` gets
the endpoint's default budget, cut to what the model's context leaves; `max_tokens` over it is refused, as are
more than `openai_requests.MAX_ROWS_PER_REQUEST` samples and a `model` other than the served one (404).
`top_k`, `top_p` and `min_p` are honoured as on the OpenAI routes (the logprobs are those of the filtered
distribution).

Every field we do not serve is refused with 400 naming it, never ignored; fields that change no sample and no
returned token are accepted: `cache_salt`, `priority` (no prefix cache, no scheduler priorities here),
`sampling_params.skip_special_tokens`, `spaces_between_special_tokens`, `detokenize`,
`include_stop_str_in_output` (no text is returned), `routed_experts_prompt_start` (no expert routing is
returned), and the others at their no-op values (penalties 0, `repetition_penalty: 1`, `min_tokens: 0`,
`ignore_eos: false`).
"""

from __future__ import annotations

import uuid
from typing import Any, Optional, Sequence, Union

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field

PATH = "/inference/v1/generate"
"""Where the route is mounted: at the server's root, not under `/v1` (vLLM's convention, which the
`renderers` client follows: it strips `/v1` off its base URL)."""

IGNORED = frozenset({"cache_salt", "priority"})
"""Top-level fields accepted and ignored: they change no sample."""
IGNORED_SAMPLING = frozenset({
    "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "include_stop_str_in_output",
    "routed_experts_prompt_start",
})
"""`sampling_params` fields accepted and ignored: they shape text or data we do not return."""
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "ignore_eos": (False,),
    "prompt_logprobs": (None,),
}
"""`sampling_params` fields we do not implement, accepted only at the value that changes nothing."""


class GenerateSamplingParams(BaseModel):
    """`sampling_params` of a generate request: the fields we serve; any other is checked by `refusals`."""

    model_config = ConfigDict(extra="allow")

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    logprobs: Optional[int] = None


class GenerateRequest(BaseModel):
    """A generate request: the prompt as token ids, and how to sample it."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    request_id: Optional[str] = None
    stream: Optional[bool] = None


def refusals(req: GenerateRequest) -> list[str]:
    """Each field of `req` we do not serve, named as it sits in the request (`sampling_params.top_k=50`)."""
    out = [k for k in (req.model_extra or {}) if k not in IGNORED]
    if req.stream:
        out.append("stream")
    sp = req.sampling_params
    for k, v in (sp.model_extra or {}).items():
        if k in IGNORED_SAMPLING or _no_op(k, v):
            continue
        out.append(f"sampling_params.{k}={v!r}")
    if sp.logprobs not in (None, 0, 1):
        out.append(f"sampling_params.logprobs={sp.logprobs!r} (top alternatives: only the sampled token's logprob, "
                   "logprobs 0 or 1, is returned)")
    return out


def _no_op(name: str, value) -> bool:
    values = NO_OP_VALUES.get(name, ())
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)


def filters(sp: GenerateSamplingParams) -> dict:
    """`top_k`, `top_p`, `min_p` as `SamplingParams` takes them (vLLM's -1: no top_k)."""
    return {"top_k": max(sp.top_k, 0), "top_p": sp.top_p, "min_p": sp.min_p}


def check(req: GenerateRequest, vocab_size: int, model_name: str) -> None:
    """400 naming the first problem: a field we do not serve, or a value out of range; 404: another model."""
    if req.model and req.model != model_name:
        raise HTTPException(status_code=404, detail=f"model {req.model!r} is not served here: this endpoint serves "
                                                    f"{model_name!r} (GET /v1/models)")
    problems = refusals(req)
    if problems:
        raise HTTPException(status_code=400, detail=f"unsupported: {', '.join(problems)}")
    sp = req.sampling_params
    if sp.n < 1:
        raise HTTPException(status_code=400, detail=f"sampling_params.n must be >= 1, got {sp.n}")
    if sp.temperature < 0:
        raise HTTPException(status_code=400, detail=f"sampling_params.temperature must be >= 0, got {sp.temperature}")
    for ok, what in ((0 < sp.top_p <= 1, f"top_p must be in (0, 1], got {sp.top_p}"),
                     (sp.top_k >= -1, f"top_k must be >= 1 (0 or -1: all), got {sp.top_k}"),
                     (0 <= sp.min_p <= 1, f"min_p must be in [0, 1], got {sp.min_p}")):
        if not ok:
            raise HTTPException(status_code=400, detail=f"sampling_params.{what}")
    for name, ids in (("token_ids", req.token_ids), ("sampling_params.stop_token_ids", sp.stop_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise HTTPException(status_code=400,
                                detail=f"{name} holds {bad[0]}, outside the vocabulary [0, {vocab_size})")


def response_body(req: GenerateRequest, choices: Sequence[tuple[list[int], list[float], str, Optional[list[int]]]]
                  ) -> dict:
    """The answer to `req` from its samples, each (token ids, logprobs, finish_reason, weight steps or None)."""
    want_logprobs = req.sampling_params.logprobs is not None
    out, n_out = [], 0
    for index, (tokens, logprobs, finish_reason, weight_steps) in enumerate(choices):
        content = None
        if want_logprobs:
            content = {"content": [{"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
                                   for t, lp in zip(tokens, logprobs)]}
        out.append({"index": index, "token_ids": tokens, "finish_reason": finish_reason, "logprobs": content,
                    "weight_steps": weight_steps})
        n_out += len(tokens)
    n_in = len(req.token_ids)
    return {
        "request_id": req.request_id or f"gen-{uuid.uuid4().hex}",
        "prompt_token_ids": list(req.token_ids),
        "choices": out,
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
    }
