"""The server's model, tokenizer and operations routes: GET /v1/models (and /v1/models/{id}),
POST /tokenize, POST /detokenize; GET /health, /ping, /version and /metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm import __version__
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.errors import OpenAIError, ServerState, bad_request, error_response
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.metrics import MergedRegistry, PrometheusStatLogger


def add_model_routes(app: FastAPI, base: OpenAIServing, state: ServerState, names: list[str]) -> None:
    """/v1/models (the served names and any LoRA adapters), /tokenize and /detokenize."""
    async_engine = base.async_engine
    mc = async_engine.model_config

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=n, root=mc.path, max_model_len=mc.max_model_len) for n in names]
        cards += state.models.cards(ModelCard) if state.models is not None else []  # --extra-models
        cards += state.loras.cards(ModelCard, mc.max_model_len) if state.loras is not None else []
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        if state.models is not None and model_id in state.models.entries:  # an extra model (--extra-models)
            card = next(c for c in state.models.cards(ModelCard) if c.id == model_id)
            return Response(card.model_dump_json(), media_type="application/json")
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


def add_operation_routes(app: FastAPI, async_engine: AsyncLLMEngine, prometheus: PrometheusStatLogger,
                         more_registries: Callable[[], list[Any]] | None = None) -> None:
    """/health and /ping (503 once the engine has failed), /version and /metrics (open routes;
    `more_registries`: the extra models' metrics, merged with the main model's)."""
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
        registry: Any = prometheus.registry
        if more_registries is not None:
            registry = MergedRegistry([prometheus.registry, *more_registries()])
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
