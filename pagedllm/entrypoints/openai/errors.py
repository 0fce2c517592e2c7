"""Errors of the OpenAI-compatible server and how engine exceptions map to HTTP.

Bad input 400 (a ValueError from validation), unknown model 404, body too large 413, unsupported
media type 415, full queue 429, shutting down 503, a dead engine 500 (and /health 503), a request
that failed inside the engine 500; the body is always the OpenAI error object."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered with the OpenAI error object and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def to_openai_error(e: BaseException) -> OpenAIError:
    """Maps engine exceptions to HTTP: bad input 400, full queue 429, dead engine or anything else 500."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(500, str(e), type="server_error", code="engine_dead")
    if isinstance(e, RequestFailedError):
        return OpenAIError(500, str(e), type="server_error", code="request_failed")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    logger.error("unexpected error while serving a request", exc_info=e)
    return OpenAIError(500, f"internal server error: {type(e).__name__}", type="server_error")


@dataclass
class ServerState:
    """Shared by the routes of one app; `shutting_down` ends requests in flight (503) so that a
    graceful shutdown does not wait for long generations."""

    shutting_down: bool = False
    loras: Any = None
    """The served LoRA adapters by name (entrypoints/openai/lora.py's LoRAAdapters), with --enable-lora."""
    models: Any = None
    """The extra models (--extra-models; entrypoints/openai/model_pool.py's ModelPool), if any."""


def shutting_down_error() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5"})


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's validation errors as one 400 naming the first problem."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return bad_request(f"malformed JSON body: {ctx.get('error', 'invalid JSON')}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union members add their type name to the location ("prompt.str"); keep the field path.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    msg = first.get("msg", "invalid value")
    if "input" in first and first.get("type") not in ("missing",):
        shown = json.dumps(first["input"], default=str)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = f"{msg} (got {shown})"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return bad_request(f"invalid request: {where}: {msg}{more}", param)
