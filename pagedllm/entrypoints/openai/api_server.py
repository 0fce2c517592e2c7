"""The OpenAI-compatible HTTP server: a FastAPI app around one AsyncLLMEngine, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (GET /v1/responses/{id}),
POST /v1/messages (/v1/messages/count_tokens; Anthropic's API), GET /v1/models, POST /tokenize,
POST /detokenize, POST /v1/embeddings, /pooling, /score, /rerank (serving_pooling.py), GET /docs, /redoc,
/openapi.json (all behind --api-key when given), GET /health, GET /metrics, GET /version (open).
Every error is the OpenAI error object {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import importlib.util
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__, envs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.anthropic import protocol as anthropic_protocol
from pagedllm.entrypoints.anthropic.serving import add_messages_routes
from pagedllm.entrypoints.openai.lora import LoRAAdapters, add_lora_routes
from pagedllm.entrypoints.openai.json_body import surrogate_error
from pagedllm.entrypoints.openai.responses.serving import add_responses_routes
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, add_pooling_routes
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    ServerState,
    bad_request,
    error_response,
    to_openai_error,
    validation_error,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.metrics import PrometheusStatLogger

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
# After a 413 the server reads and drops the rest of the body, at most this much for this long,
# so that the client, which reads the answer once it has sent its body, gets it (a server that
# closes with bytes unread resets the connection, and the client loses the answer); a client
# that sends more, or for longer, has its connection closed.
DRAIN_MAX_BYTES = 64 << 20
DRAIN_MAX_S = 30.0
# After an engine fault the server answers (503) for this long, then exits with code 1.
ENGINE_DEAD_EXIT_DELAY_S = 1.0
# Routes open without an API key; every other route is guarded when keys are configured.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
                           "/pooling", "/score", "/rerank"})


# ---- API keys and body size: plain ASGI, before any routing or body parsing -----------------
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
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect when the client leaves

        await self.app(scope, replay, send)

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


# ---- the app ----------------------------------------------------------------------------------
def build_app(
    async_engine: AsyncLLMEngine,
    served_model_names: list[str] | None = None,
    api_keys: list[str] | None = None,
    max_logprobs: int = 20,
    chat_template: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    stat_logger: PrometheusStatLogger | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    enable_ui: bool = True,
    responses_store_size: int = 1000,
    lora_modules: list[Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving `async_engine` (which the caller starts and shuts down)."""
    mc, cc = async_engine.model_config, async_engine.config.cache_config
    names = list(served_model_names or [mc.served_model_name])
    if stat_logger is None:
        stat_logger = next((s for s in async_engine.stat_loggers if isinstance(s, PrometheusStatLogger)), None)
    if stat_logger is None:
        stat_logger = PrometheusStatLogger(
            names[0], mc.max_model_len, cc.block_size, async_engine.num_blocks, cc.enable_prefix_caching
        )
        async_engine.stat_loggers.append(stat_logger)
    prometheus = stat_logger
    state = ServerState()
    state.loras = LoRAAdapters.create(async_engine, names, lora_modules)  # None without --enable-lora
    completions = OpenAIServingCompletion(async_engine, names, max_logprobs, chat_template, state)
    chat = OpenAIServingChat(async_engine, names, max_logprobs, chat_template, state,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser)
    base = OpenAIServing(async_engine, names, max_logprobs, chat_template, state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()  # engine-core messages reach this event loop from now on
        yield

    app = FastAPI(title="pagedllm", version=__version__, description="OpenAI-compatible LLM server",
                  lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.server_state = state
    app.state.stat_logger = prometheus

    # ---- errors ---------------------------------------------------------------------------
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        err = OpenAIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_openai_error(exc))

    async def guarded(coro: Any) -> Response:
        try:
            return await coro
        except Exception as e:
            return error_response(to_openai_error(e))

    # ---- inference ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        prometheus.count_request("completions")
        return await guarded(completions.create_completion(body, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        prometheus.count_request("chat_completions")
        return await guarded(chat.create_chat_completion(body, raw_request))

    add_messages_routes(app, chat, prometheus.count_request)  # Anthropic's Messages API over chat
    add_responses_routes(app, chat, responses_store_size, prometheus.count_request)  # OpenAI's Responses API
    add_pooling_routes(app, OpenAIServingPooling(async_engine, names, max_logprobs, None, state), prometheus.count_request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=n, root=mc.path, max_model_len=mc.max_model_len) for n in names]
        cards += state.loras.cards(ModelCard, mc.max_model_len) if state.loras is not None else []
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        name = base.model_name(model_id)
        cards = state.loras.cards(ModelCard, mc.max_model_len) if state.loras is not None else []
        card = next((c for c in cards if c.id == name), None) or ModelCard(id=name, root=mc.path,
                                                                           max_model_len=mc.max_model_len)
        return Response(card.model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        base.model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty", "messages")
            if body.add_special_tokens:
                raise bad_request("add_special_tokens is not supported with messages", "add_special_tokens")
            messages = body.messages
            p = await base.run_blocking(
                lambda: base.render_chat(messages, body.add_generation_prompt, body.continue_final_message),
                sum(len(m.content) if isinstance(m.content, str) else 0 for m in messages),
            )
        elif isinstance(body.prompt, str):
            text, add = body.prompt, body.add_special_tokens is not False
            p = await base.run_blocking(lambda: base.prompt_from_text(text, add), len(text))
        else:
            p = base.prompt_from_ids(body.prompt or [])
        resp = TokenizeResponse(tokens=p.token_ids, count=len(p.token_ids), max_model_len=mc.max_model_len)
        return Response(resp.model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        base.model_name(body.model)
        vocab = mc.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:8]} are out of vocabulary (vocab size {vocab})", "tokens")
        text = async_engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    # ---- operations -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if async_engine.errored:
            err = OpenAIError(503, f"the engine has failed: {async_engine.dead_error!r}", type="server_error",
                              code="engine_dead", headers={"Retry-After": "60"})
            return error_response(err)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        # Only what the engine core pushed with its outputs: a scrape never waits on the engine.
        return Response(generate_latest(prometheus.registry), media_type=CONTENT_TYPE_LATEST)

    if state.loras is not None:
        add_lora_routes(app, state.loras)
    if enable_ui:  # the page at / and its engine feed (entrypoints/web)
        from pagedllm.entrypoints.web.routes import add_ui_routes

        add_ui_routes(app, async_engine)
    app.add_middleware(GuardMiddleware, api_keys=list(api_keys or []), max_body_bytes=max_body_bytes)
    return app


# ---- running it -------------------------------------------------------------------------------
def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host!r}: {e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class HeaderTimeoutMixin:
    """A bound on reading a request's headers, for uvicorn's HTTP/1.1 protocols (h11 and httptools):
    a connection that has not sent complete headers `header_read_timeout` seconds after it opened,
    or after the first bytes of its next request, is closed, so that slow-header clients cannot
    hold connections open forever. Between a response and the next request's first bytes the
    connection is idle, and uvicorn's keep-alive timeout (--timeout-keep-alive) bounds it instead."""

    header_read_timeout = 10.0
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._idle = False
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._idle = True

    def data_received(self, data: bytes) -> None:
        # The next request begins (not bytes of a request already in progress, as a pipelined
        # one would be): its headers get the same bound as the first request's.
        if self._idle and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()
        self._idle = False
        super().data_received(data)  # type: ignore[misc]

    def _arm_header_timer(self) -> None:
        cycle = self.cycle  # a new request replaces it as soon as its headers are in

        def expire() -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

        self.loop.call_later(self.header_read_timeout, expire)


def _resolve(flag: str, value: str, fast: str, fallback: str) -> str:
    """`auto` is `fast` (a C implementation) when it is installed, else `fallback` (as uvicorn decides)."""
    if value == "auto":
        return fast if importlib.util.find_spec(fast) is not None else fallback
    if value not in (fallback, fast):
        raise ValueError(f"{flag} must be auto, {fallback} or {fast}, got {value!r}")
    return value


resolve_http_impl = functools.partial(_resolve, "--uvicorn-http", fast="httptools", fallback="h11")
resolve_loop = functools.partial(_resolve, "--uvicorn-loop", fast="uvloop", fallback="asyncio")


def http_protocol(impl: str, header_read_timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol class for `impl` (h11 or httptools) with the header-read bound."""
    if impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return type(f"HeaderTimeout{base.__name__}", (HeaderTimeoutMixin, base), {"header_read_timeout": header_read_timeout})


class _Server(uvicorn.Server):
    """uvicorn's server, which first tells requests in flight to end (they answer 503) so that its
    graceful shutdown does not wait for long generations."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.app_state.shutting_down = True
        super().handle_exit(sig, frame)


def run_server(args: argparse.Namespace) -> int:
    """Claims the address, loads the engine, serves until SIGINT/SIGTERM, then shuts down cleanly."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import LoggingStatLogger
    from pagedllm.engine.core_client import EngineStartError

    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be at least 1, got {args.max_queued_requests}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not args.header_read_timeout > 0:
        raise ValueError(f"--header-read-timeout must be positive, got {args.header_read_timeout}")
    if not args.timeout_keep_alive > 0:
        raise ValueError(f"--timeout-keep-alive must be positive, got {args.timeout_keep_alive}")
    # Decided once, before the model loads: _serve and its start-up line use the names chosen here.
    args.uvicorn_http, args.uvicorn_loop = resolve_http_impl(args.uvicorn_http), resolve_loop(args.uvicorn_loop)
    chat_template = load_chat_template(args.chat_template)
    api_keys = list(args.api_key or [])
    env_key = envs.PAGEDLLM_API_KEY
    if not api_keys and env_key:
        api_keys = [env_key]
    engine_args = EngineArgs.from_cli_args(args)
    # Claim the address first (a busy port fails before a long model load); connections are
    # refused until uvicorn starts listening on it, after the engine is ready.
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    loggers: list[Any] = [] if args.disable_log_stats else [LoggingStatLogger()]
    try:
        logger.info("Loading model %s in the engine-core process", engine_args.model or "smollm2-135m-instruct")
        async_engine = AsyncLLMEngine.from_engine_args(
            engine_args, log_level=args.log_level, max_queued_requests=args.max_queued_requests,
            stat_loggers=loggers,
        )
    except EngineStartError as e:
        sock.close()
        logger.error("the engine could not start: %s", e)
        return 1
    except BaseException:
        sock.close()
        raise
    try:
        return _serve(args, async_engine, sock, chat_template, api_keys)
    finally:
        async_engine.shutdown()  # never leaves the engine-core process behind
        sock.close()


def _serve(
    args: argparse.Namespace, async_engine: AsyncLLMEngine, sock: socket.socket, chat_template: str | None,
    api_keys: list[str],
) -> int:
    host, port = sock.getsockname()[:2]
    mc = async_engine.model_config
    if chat_template is not None:
        async_engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=chat_template)
    names = [mc.served_model_name]
    app = build_app(
        async_engine,
        served_model_names=names,
        api_keys=api_keys,
        max_logprobs=args.max_logprobs,
        chat_template=chat_template,
        max_body_bytes=args.max_request_body_size,
        responses_store_size=getattr(args, "responses_store_size", 1000),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        enable_ui=not getattr(args, "disable_ui", False),
        lora_modules=getattr(args, "lora_modules", None),
    )
    if not api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=args.timeout_keep_alive,
        http=http_protocol(args.uvicorn_http, args.header_read_timeout),
        loop=args.uvicorn_loop,
    )
    server = _Server(config, app.state.server_state)
    exit_code = 0

    def on_engine_dead() -> None:
        # Every request in flight has its error already. /health answers 503 for a moment, then
        # the server exits non-zero so that a supervisor restarts it.
        nonlocal exit_code
        exit_code = 1
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))

    async_engine.on_dead.append(on_engine_dead)
    shown = f"[{host}]" if ":" in host else host
    logger.info(
        "Serving %s at http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions; HTTP parser %s, "
        "event loop %s)", names[0], shown, port, args.uvicorn_http, args.uvicorn_loop,
    )
    # uvicorn re-raises the signal that stopped it after its graceful shutdown, to the handlers
    # in place before it started: make those no-ops so SIGINT/SIGTERM end with exit code 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if exit_code:
        logger.error("Server stopped: the engine failed (exit code %d)", exit_code)
    else:
        logger.info("Server stopped")
    return exit_code
