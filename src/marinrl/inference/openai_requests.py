"""What the OpenAI routes accept: the bodies of `/v1/completions` and `/v1/chat/completions`, the options refused
with 400 rather than ignored (`stream`, `echo`, penalties, `logit_bias`, `best_of` > 1, `top_logprobs`,
`response_format` other than text, `tools`, and any field this module does not know), the served model's name,
and the prompts, messages, stop strings, token budgets and row counts the bodies carry.

`top_k`, `top_p`, `min_p`, `seed` and `stop` are honoured (the scan sampler's `_pick`). Every problem is an
`HTTPException(400)` naming the field (404 for a model not served here); the endpoint answers it in OpenAI's
error format.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict


class OpenAIRequest(BaseModel):
    """The sampling fields both routes share."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None


class CompletionRequest(OpenAIRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None


MAX_ROWS_PER_REQUEST = 256
"""The most samples one request may ask for (prompts x `n`): more is refused with 400 before any work; the rows
of one prompt must also fit one device call's KV cache (`InferenceServer._admit`)."""

IGNORED = frozenset({"user", "metadata", "store"})
"""Fields accepted and ignored: they change no sample and no returned text."""
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "stream_options": (None,),
    "parallel_tool_calls": (None,), "repetition_penalty": (1, 1.0), "min_tokens": (0,), "ignore_eos": (False,),
    "skip_special_tokens": (True,), "n_probs": (None,),
}
"""Fields we do not implement, accepted only at the value that changes nothing."""


def refuse_unsupported(req: OpenAIRequest, model_name: str) -> None:
    """400 naming every option of `req` we do not implement, or a value out of range; 404 for another model."""
    if req.model and req.model != model_name:
        raise HTTPException(status_code=404, detail=f"model {req.model!r} is not served here: this endpoint serves "
                                                    f"{model_name!r} (GET /v1/models)")
    problems = [k for k, v in (req.model_extra or {}).items()
                if k not in IGNORED and not any(v == ok for ok in NO_OP_VALUES.get(k, ()))]
    if req.stream:
        problems.append("stream")
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
    for ok, what in ((req.n >= 1, f"n must be >= 1, got {req.n}"),
                     (req.temperature >= 0, f"temperature must be >= 0, got {req.temperature}"),
                     (req.top_p is None or 0 < req.top_p <= 1, f"top_p must be in (0, 1], got {req.top_p}"),
                     (req.top_k is None or req.top_k >= -1, f"top_k must be >= 1 (0 or -1: all), got {req.top_k}"),
                     (req.min_p is None or 0 <= req.min_p <= 1, f"min_p must be in [0, 1], got {req.min_p}")):
        if not ok:
            raise HTTPException(status_code=400, detail=what)


def filters(req: OpenAIRequest) -> dict:
    """The request's `top_k`, `top_p` and `min_p` as `SamplingParams` takes them (vLLM's -1: no top_k)."""
    return {"top_k": max(req.top_k or 0, 0), "top_p": 1.0 if req.top_p is None else req.top_p,
            "min_p": req.min_p or 0.0}


def token_budget(given: Optional[int], field: str, prompt_tokens: int, default: int, context: Optional[int],
                 context_source: str) -> int:
    """The new-token budget of a prompt: `given` if it is >= 1 and fits the model's context with the prompt, else
    400 naming `field`; none given: `default`, cut to what the context leaves."""
    if given is not None and given < 1:
        raise HTTPException(status_code=400, detail=f"{field} must be >= 1, got {given}")
    if context is None:
        return default if given is None else given
    room = context - prompt_tokens
    if room < 1:
        raise HTTPException(status_code=400, detail=f"the prompt ({prompt_tokens} tokens) fills the model's context "
                                                    f"of {context} tokens ({context_source})")
    if given is None:
        return min(default, room)
    if given > room:
        raise HTTPException(status_code=400, detail=f"{field} is {given}, but the prompt ({prompt_tokens} tokens) "
                                                    f"leaves {room} of the model's context of {context} tokens "
                                                    f"({context_source}): ask for {field} <= {room}")
    return given


def check_rows(n: int, prompts: int, field: str = "n") -> None:
    """400 when a request asks for more samples than `MAX_ROWS_PER_REQUEST`."""
    if n * prompts > MAX_ROWS_PER_REQUEST:
        raise HTTPException(status_code=400, detail=f"{field}={n} x {prompts} prompt(s) asks for {n * prompts} samples"
                                                    f", over the endpoint's {MAX_ROWS_PER_REQUEST} a request: split "
                                                    "it into several requests")


def invalid_body_message(exc: RequestValidationError) -> str:
    """A body that does not parse (a missing or mistyped field), each field named, as OpenAI answers it."""
    problems = [f"{'.'.join(str(part) for part in e['loc'] if part != 'body') or 'body'}: {e['msg']}"
                for e in exc.errors()]
    return f"invalid request: {'; '.join(problems)}"


def stop_list(stop) -> list[str]:
    """A request's `stop` as a list of non-empty strings."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise HTTPException(status_code=400, detail="empty stop string")
    return stops


def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    """A completion request's prompt (a string, strings, token ids or lists of them) as token-id prompts."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if len(prompt) == 0:
        raise HTTPException(status_code=400, detail="empty prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in prompt]


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The request's messages as the chat template takes them: text content only."""
    return [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]


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
