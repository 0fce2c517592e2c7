"""The plain ASGI layer that routes a request to the model its body names (`--extra-models`).

A POST whose JSON body's `model` names an extra model goes to that model's own app (the same
routes, its own engine; model_pool.py loads it first if needed); everything else, the main model's
requests and an unknown name's 404 among them, goes on to the main app. It sits behind
GuardMiddleware, so the API key and the body's size are checked before it reads the body."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.anthropic import protocol as anthropic_protocol
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response
from pagedllm.entrypoints.openai.guard import replaying
from pagedllm.entrypoints.openai.model_pool import ModelPool


def requested_model(body: bytes) -> str | None:
    """The body's top-level `model` string, or None (no JSON object, no such field)."""
    if b'"model"' not in body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the main app answers 400 for the malformed body
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


class ModelRouter:
    def __init__(self, app: ASGIApp, pool: ModelPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body came
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replay = replaying(body, receive)

        name = requested_model(body)
        if name is None or name not in self.pool.entries:
            await self.app(scope, replay, send)
            return
        try:
            await self.pool.serve(name, scope, replay, send)
        except OpenAIError as e:  # the model could not be loaded (nothing has been sent yet)
            anthropic = scope["path"].startswith("/v1/messages")
            await (anthropic_protocol.error_response if anthropic else error_response)(e)(scope, receive, send)
