"""`pagedllm serve [MODEL]`: vLLM's server flags plus every engine flag."""

from __future__ import annotations

import argparse
from typing import Any

# Idle keep-alive connections outlive the client pools' own expiry (httpx / openai 5 s, aiohttp 15 s):
# the client drops an idle connection first, so it never sends a request on one that the server
# closes at that moment (with equal timeouts, one request in a few thousand failed that way).
KEEP_ALIVE_S = 20.0


def _lora_module(text: str) -> Any:
    from pagedllm.entrypoints.openai.lora import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _extra_model(text: str) -> Any:
    from pagedllm.entrypoints.openai.model_pool import parse_extra_model

    try:
        return parse_extra_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedllm.config import SERVE_MAX_NUM_SHARED_PREFILL_TOKENS
    from pagedllm.engine.arg_utils import EngineArgs, parse_size

    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).",
    )
    EngineArgs.add_cli_args(p, model_positional=True)
    # Chat clients wait for first tokens: the server caps a shared step's prompt tokens (config.py).
    p.set_defaults(max_num_shared_prefill_tokens=SERVE_MAX_NUM_SHARED_PREFILL_TOKENS)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", action="append", default=None,
                   help="key clients must send as 'Authorization: Bearer <key>' (repeatable; "
                        "default: the PAGEDLLM_API_KEY environment variable, if set)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="most requests waiting for the engine; more are answered 429 (default: no limit)")
    add_serving_args(g)
    g.add_argument("--extra-models", nargs="+", action="extend", default=None, type=_extra_model,
                   metavar="NAME=MODEL",
                   help="more base models served beside MODEL, each in its own engine, picked by the request's "
                        "`model`: NAME=folder, .gguf or built-in name, or JSON {\"name\": ..., \"model\": ..., "
                        "<engine flag>: ...} for flags of its own (others: the server's); loaded on first request "
                        "(docs/multi-model.md)")
    g.add_argument("--model-idle-unload-s", type=float, default=None,
                   help="seconds without requests after which an extra model is unloaded (loaded again on "
                        "demand; default 0: never)")
    g.add_argument("--max-loaded-models", type=int, default=None,
                   help="most models loaded at once, the main one included; the least recently used idle one "
                        "is unloaded first (default: all); the KV budget is split between this many")
    g.add_argument("--responses-store-size", type=int, default=1000,
                   help="responses /v1/responses keeps for previous_response_id and GET (least recently used go)")
    g.add_argument("--max-request-body-size", type=parse_size, default=8 << 20,
                   help="largest request body accepted, e.g. 8MiB (default); larger ones get 413")
    g.add_argument("--header-read-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers before it is closed")
    g.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open after a response (default "
                        f"{KEEP_ALIVE_S:g}: longer than HTTP clients keep idle pooled connections, httpx and "
                        "the openai client 5 s, aiohttp 15 s, so a client never reuses one the server is closing)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    g.add_argument("--disable-ui", action="store_true", help="no web page at / and no engine feed at /v1/engine/state")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    g.add_argument("--uvicorn-http", default="auto", choices=("auto", "h11", "httptools"),
                   help="uvicorn's HTTP/1.1 implementation (default auto: httptools when installed, else h11)")
    g.add_argument("--uvicorn-loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="the server's event loop (default auto: uvloop when installed, else asyncio)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    p.set_defaults(func=_serve)
    return p


def add_serving_args(g: Any) -> None:
    """The flags of the OpenAI serving layer (chat template, logprobs, tools, LoRA adapters by
    name) that `serve` and `run-batch` share."""
    g.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module, metavar="NAME=PATH",
                   help="LoRA adapters served by name (with --enable-lora): name=path or JSON "
                        '{"name": ..., "path": ..., "base_model_name": ...}')
    g.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs a request may ask")
    g.add_argument("--chat-template", default=None,
                   help="chat template: a file path or the Jinja template itself (default: the model's)")
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice "auto", the default when a request has '
                        "tools); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the format the model writes tool calls in (docs/structured-output.md#tool-calling)")


def check_serving_args(args: argparse.Namespace) -> None:
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs must be non-negative, got {args.max_logprobs}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)")


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    check_serving_args(args)
    return run_server(args)
