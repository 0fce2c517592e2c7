"""The server's first layer, plain ASGI before any routing or body parsing: the API key on guarded
routes (401), the body's size (413, then the rest of the body drained), its Content-Type (415) and
its text (400 for lone surrogates)."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.anthropic import protocol as anthropic_protocol
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_response
from pagedllm.entrypoints.openai.json_body import surrogate_error

DEFAULT_MAX_BODY_BYTES = 8 << 20
# After a 413 the server reads and drops the rest of the body, at most this much for this long,
# so that the client, which reads the answer once it has sent its body, gets it (a server that
# closes with bytes unread resets the connection, and the client loses the answer); a client
# that sends more, or for longer, has its connection closed.
DRAIN_MAX_BYTES = 64 << 20
DRAIN_MAX_S = 30.0
# Routes open without an API key; every other route is guarded when keys are configured.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
                           "/pooling", "/score", "/rerank", "/v2/rerank"})



def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive callable that gives the app `body` (already read from `receive`) as one message,
    then passes on to `receive` (http.disconnect when the client leaves)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

class GuardMiddleware:
    """Checks `Authorization: Bearer <key>` on guarded routes (401), then caps the request body
    (413, from Content-Length or while reading a chunked body: answered at once, then the rest is
    drained, see `reject`), and replays the body to the app."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int, drain_max_bytes: int = DRAIN_MAX_BYTES,
                 drain_max_s: float = DRAIN_MAX_S) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.drain_max_bytes, self.drain_max_s = drain_max_bytes, drain_max_s

    @staticmethod
    def guarded(path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or path in GUARDED_PATHS

    def authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        token = token or headers.get(b"x-api-key", b"").strip()  # Anthropic's clients send x-api-key
        if not token:
            return False
        # Compare against every key so the time taken does not depend on which one matches.
        return any([hmac.compare_digest(token, key) for key in self.api_keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_keys and self.guarded(scope["path"]) and not self.authorized(scope):
            err = OpenAIError(
                401,
                "Missing or invalid API key: send it as 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            anthropic = scope["path"].startswith("/v1/messages")
            await (anthropic_protocol.error_response if anthropic else error_response)(err)(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_large = OpenAIError(
            413,
            f"the request body is larger than the server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-size)",
            code="request_too_large",
            # The connection carries no other request: it closes once the body has been drained.
            headers={"Connection": "close"},
        )
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await error_response(bad_request(f"invalid Content-Length {length.decode(errors='replace')!r}"))(
                    scope, receive, send
                )
                return
            if declared > self.max_body_bytes:
                await self.reject(too_large, scope, receive, send)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type and not (content_type == b"application/json" or content_type.endswith(b"+json")):
            err = OpenAIError(
                415,
                f"Content-Type must be application/json, got {content_type.decode(errors='replace')!r} "
                "(e.g. curl -H 'Content-Type: application/json')",
                code="unsupported_media_type",
            )
            await error_response(err)(scope, receive, send)
            return
        if not content_type:  # no label at all: read the body as the JSON it must be
            raw = list(scope.get("headers") or [])
            scope = {**scope, "headers": [*raw, (b"content-type", b"application/json")]}
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self.reject(too_large, scope, receive, send, more_body=message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        bad = surrogate_error(body)
        if bad is not None:
            await error_response(bad)(scope, receive, send)
            return
        await self.app(scope, replaying(body, receive), send)

    async def reject(self, err: OpenAIError, scope: Scope, receive: Receive, send: Send,
                     more_body: bool = True) -> None:
        """Answers `err` before the body is read, then reads and drops the body (up to
        drain_max_bytes, for up to drain_max_s) before the response ends and the connection
        closes. The answer goes out first (a client that waits for `100 Continue`, or reads while
        it sends, stops sending), but its end waits for the drain: uvicorn closes the connection
        when the response ends, and closing with the client's bytes unread resets it. A client
        still sending its body then fails on a write before it reads the answer (http.client,
        requests), or reads it only if the reset has not dropped it (httpx, the openai client)."""

        async def send_open(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "more_body": True}
            await send(message)

        await error_response(err)(scope, receive, send_open)
        loop = asyncio.get_running_loop()
        deadline, drained = loop.time() + self.drain_max_s, 0
        while more_body and drained <= self.drain_max_bytes:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
            if message["type"] != "http.request":  # the client has gone
                break
            drained += len(message.get("body", b""))
            more_body = message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
