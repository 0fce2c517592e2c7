"""The OpenAI-compatible HTTP server: a FastAPI app around one AsyncLLMEngine, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (GET /v1/responses/{id}),
POST /v1/messages (/v1/messages/count_tokens; Anthropic's API), GET /v1/models, POST /tokenize,
POST /detokenize (routes_basic.py), POST /v1/embeddings, /pooling, /score, /rerank (serving_pooling.py),
GET /docs, /redoc, /openapi.json (all behind --api-key when given, guard.py), GET /health, GET /metrics,
GET /version (open, routes_basic.py). Every error is the OpenAI error object
{"error": {"message", "type", "param", "code"}}. http_server.py holds the socket and uvicorn protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__, envs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.anthropic.serving import add_messages_routes
from pagedllm.entrypoints.openai.guard import DEFAULT_MAX_BODY_BYTES, GuardMiddleware
from pagedllm.entrypoints.openai.http_server import bind_socket, http_protocol, resolve_http_impl, resolve_loop
from pagedllm.entrypoints.openai.lora import LoRAAdapters, add_lora_routes
from pagedllm.entrypoints.openai.model_pool import ModelPool
from pagedllm.entrypoints.openai.model_router import ModelRouter
from pagedllm.entrypoints.openai.responses.serving import add_responses_routes
from pagedllm.entrypoints.openai.routes_basic import add_model_routes, add_operation_routes
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, add_pooling_routes
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    ServerState,
    error_response,
    to_openai_error,
    validation_error,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.metrics import PrometheusStatLogger

logger = logging.getLogger(__name__)

# After an engine fault the server answers (503) for this long, then exits with code 1.
ENGINE_DEAD_EXIT_DELAY_S = 1.0


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
    model_pool: ModelPool | None = None,
) -> FastAPI:
    """The FastAPI app serving `async_engine` (which the caller starts and shuts down), and the
    extra models of `model_pool` (--extra-models), each through an app of its own."""
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
    state.models = model_pool
    completions = OpenAIServingCompletion(async_engine, names, max_logprobs, chat_template, state)
    chat = OpenAIServingChat(async_engine, names, max_logprobs, chat_template, state,
                             enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser)
    base = OpenAIServing(async_engine, names, max_logprobs, chat_template, state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()  # engine-core messages reach this event loop from now on
        if model_pool is not None:
            model_pool.start()
        yield
        if model_pool is not None:
            await model_pool.close()

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

    add_model_routes(app, base, state, names)
    add_operation_routes(app, async_engine, prometheus, model_pool.registries if model_pool is not None else None)

    if state.loras is not None:
        add_lora_routes(app, state.loras)
    if enable_ui:  # the page at / and its engine feed (entrypoints/web)
        from pagedllm.entrypoints.web.routes import add_ui_routes

        add_ui_routes(app, async_engine)
    if model_pool is not None:  # inside the guard: the API key and the body's size are checked first
        app.add_middleware(ModelRouter, pool=model_pool)
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



class _Server(uvicorn.Server):
    """uvicorn's server, which first tells requests in flight to end (they answer 503) so that its
    graceful shutdown does not wait for long generations."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.app_state.shutting_down = True
        if self.app_state.models is not None:  # the extra models' requests too
            self.app_state.models.begin_shutdown()
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
    extras, extra_args, kv_line = _extra_models(args, engine_args)
    if extras:
        engine_args = extra_args.pop(0)
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
    pool = None
    try:
        if extras:
            logger.info("%s", kv_line)
            pool = _model_pool(args, async_engine, extras, extra_args, chat_template is not None)
        return _serve(args, async_engine, sock, chat_template, api_keys, pool)
    finally:
        if pool is not None:
            pool.shutdown()
        async_engine.shutdown()  # never leaves the engine-core process behind
        sock.close()


def _extra_models(args: argparse.Namespace, engine_args: Any) -> tuple[list[Any], list[Any], str]:
    """--extra-models checked, and the engine args of the main model then each extra model, with
    the KV budget split between the models that may be loaded at once (model_pool.split_kv_budget)."""
    from pagedllm.engine.arg_utils import resolve_device
    from pagedllm.entrypoints.openai.model_pool import check_extra_models, split_kv_budget

    extras = list(getattr(args, "extra_models", None) or [])
    idle, max_loaded = getattr(args, "model_idle_unload_s", None), getattr(args, "max_loaded_models", None)
    check_extra_models(engine_args.served_model_name or "", extras, idle, max_loaded)
    if not extras:
        return [], [], ""
    explicit = engine_args.kv_cache_memory is not None or engine_args.num_kv_blocks is not None
    if not explicit and resolve_device(engine_args.device) != "cpu":
        raise ValueError("--extra-models on a GPU needs --kv-cache-memory (the KV bytes all loaded models share; "
                         "--gpu-memory-utilization cannot be split between engines)")
    main, others, line = split_kv_budget(engine_args, extras, max_loaded)
    return extras, [main, *others], line


def _model_pool(args: argparse.Namespace, async_engine: AsyncLLMEngine, extras: list[Any], extra_args: list[Any],
                has_chat_template: bool) -> ModelPool:
    main_name = async_engine.model_config.served_model_name
    if main_name in {e.name for e in extras}:
        raise ValueError(f"--extra-models: the name {main_name!r} is the main model's")

    def make_app(engine: AsyncLLMEngine, name: str, stat_logger: PrometheusStatLogger) -> FastAPI:
        # The server's serving options, but the model's own chat template; no UI, no key (checked before).
        return build_app(
            engine, served_model_names=[name], max_logprobs=args.max_logprobs, stat_logger=stat_logger,
            max_body_bytes=args.max_request_body_size, responses_store_size=getattr(args, "responses_store_size", 1000),
            enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
            tool_call_parser=getattr(args, "tool_call_parser", None), enable_ui=False,
        )

    if has_chat_template:
        logger.info("--chat-template applies to %s only; the extra models use their own templates", main_name)
    return ModelPool(
        main_name, [(e.name, a) for e, a in zip(extras, extra_args)], make_app,
        idle_unload_s=getattr(args, "model_idle_unload_s", None), max_loaded=getattr(args, "max_loaded_models", None),
        engine_kwargs={"log_level": args.log_level, "max_queued_requests": args.max_queued_requests},
    )


def _serve(
    args: argparse.Namespace, async_engine: AsyncLLMEngine, sock: socket.socket, chat_template: str | None,
    api_keys: list[str], model_pool: ModelPool | None = None,
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
        model_pool=model_pool,
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
    if model_pool is not None:
        model_pool.log_start()
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
