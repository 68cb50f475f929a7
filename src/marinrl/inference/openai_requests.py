"""What the OpenAI routes accept: the bodies of `/v1/completions` and `/v1/chat/completions`, the options refused
with 400 rather than ignored (`stream`, `echo`, `top_p` other than 1, penalties, `logit_bias`, `best_of` > 1,
`top_logprobs`), and the prompts, messages, stop strings and token budgets the bodies carry.

Every problem is an `HTTPException(400)` naming the field; the endpoint answers it in OpenAI's error format.
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


def refuse_unsupported(req: OpenAIRequest) -> None:
    """400 naming every option of `req` we do not implement, or a value out of range."""
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
