"""API-key authentication of the OpenAI-compatible endpoint (`openai_api.OpenAIEndpoint`).

Every request but `GET /health` must carry the endpoint's API key, `Authorization: Bearer <key>` (what
`openai.OpenAI(api_key=...)` sends); without it, or with another key, the answer is 401 in OpenAI's
error format. The key is the one given, else a random one per endpoint (`new_api_key`), which
in-process agents get from the server; it is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Optional

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key: a liveness probe, which tells the served model's name and how many
requests are in hand, nothing else."""


def new_api_key() -> str:
    """A fresh random API key (256 bits), for an endpoint started without a configured one."""
    return "marinrl-" + secrets.token_urlsafe(32)


def openai_error(status: int, message: str, *, code: Optional[str] = None, headers=None):
    """An error in OpenAI's format, so that OpenAI clients show the message."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    from fastapi.responses import JSONResponse  # fastapi only where an endpoint runs

    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": None, "code": code}})


class RequireApiKey:
    """ASGI middleware in front of every route: a request to a path outside OPEN_PATHS needs
    `Authorization: Bearer <key>`, else it gets a 401 and reaches no route."""

    def __init__(self, app, key: str):
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS:
            problem = self._problem(scope["headers"])
            if problem is not None:
                response = openai_error(401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _problem(self, headers) -> Optional[str]:
        given = next((v for k, v in headers if k == b"authorization"), None)
        if given is None:
            return ("missing API key: send the header 'Authorization: Bearer <key>' (openai.OpenAI(api_key=...)); "
                    "the key is inference.api_key, or the server's api_key when none is configured")
        scheme, _, key = given.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self._key):
            return ("incorrect API key: send the header 'Authorization: Bearer <key>' with the key of "
                    "inference.api_key, or the server's api_key when none is configured")
        return None
