"""The pooling routes: POST /v1/embeddings (OpenAI), /pooling, /score and /v1/score (vLLM), /rerank
and /v1/rerank (Jina / Cohere shapes), each input one pooling request on the engine.

A generate-runner decoder answers them too, from its last token's final hidden state (LAST,
normalised) in the same engine and step budget as its generation; a pooling server answers the
generation routes with a 400 that says how to start a generation server.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.core.pooling import check_whole_prompt
from pagedllm.entrypoints.openai.engine_call import (
    ClientDisconnected,
    EngineCall,
    EnginePrompt,
    await_unless_disconnected,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_response
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingData,
    EmbeddingInput,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    TruncationFields,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.llm_pooling import cosine, pair_token_ids, pooling_token_ids, resolve_truncation, score_pairs
from pagedllm.models.loader.pooling import is_classifier
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})


def generation_refused(name: str, path: str) -> OpenAIError:
    """The 400 a pooling model's server answers on a generation route."""
    return bad_request(f"model {name!r} is served with --runner pooling, which answers /v1/embeddings, /pooling, "
                       f"/score and /rerank, not {path}; start a generation server for it (pagedllm serve MODEL "
                       "--runner generate)", "model")


def encode_floats(values: Any, encoding_format: str) -> Any:
    """A float32 tensor as nested lists, or base64 of its little-endian float32 bytes (OpenAI's form)."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(values.numpy(), dtype="<f4").tobytes()).decode()
    return values.tolist()


class OpenAIServingPooling(OpenAIServing):
    @property
    def pooling(self) -> bool:
        return self.async_engine.model_config.runner == "pooling"

    def check_runner(self, route: str) -> None:
        """A 400 unless the engine has a pooler: every pooling model, and a generate-runner decoder
        (LAST pooling beside its generation)."""
        if self.async_engine.model_config.pooler_config is None:
            name = self.served_model_names[0]
            raise bad_request(f"model {name!r} has no pooler, so it does not serve {route}; start a pooling server: "
                              "`pagedllm serve all-minilm-l6-v2`, or `pagedllm serve MODEL --runner pooling`", "model")

    # ---- inputs ---------------------------------------------------------------------------
    def truncation(self, body: TruncationFields) -> tuple[int | None, str | None]:
        """The body's truncate_prompt_tokens (resolved: -1 is the context) and truncation_side."""
        if body.truncation_side is not None and body.truncate_prompt_tokens is None:
            raise bad_request("truncation_side applies with truncate_prompt_tokens only", "truncation_side")
        try:
            k = resolve_truncation(body.truncate_prompt_tokens, body.truncation_side, self.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from None
        return k, body.truncation_side

    def prompts(self, inp: EmbeddingInput, param: str = "input",
                cut: tuple[int | None, str | None] = (None, None)) -> list[EnginePrompt]:
        """Every input as token ids (cut to `cut`'s tokens), each checked (a 400 naming the index
        of a bad one)."""
        if isinstance(inp, str):
            items: list[Any] = [inp]
        elif inp and all(isinstance(t, int) for t in inp):
            items = [inp]
        else:
            items = list(inp)
        if not items:
            raise bad_request(f"{param} must not be empty", param)
        return [self._prompt(x, f"{param}[{i}]" if len(items) > 1 or not isinstance(inp, str) else param, param, cut)
                for i, x in enumerate(items)]

    def _prompt(self, item: str | list[int], name: str, param: str,
                cut: tuple[int | None, str | None] = (None, None)) -> EnginePrompt:
        if (isinstance(item, str) and item == "") or (isinstance(item, list) and not item):
            raise bad_request(f"{name} is empty", param)
        try:
            if cut[0] is not None:
                item = pooling_token_ids(self.tokenizer, item, *cut)
            text, ids = self.processor.tokenize_prompt(item)
        except ValueError as e:
            raise bad_request(f"{name}: {e}", param) from None
        return self.checked(EnginePrompt(ids, text if cut[0] is None else None), name, param)

    def checked(self, p: EnginePrompt, name: str, param: str) -> EnginePrompt:
        n, m = len(p.token_ids), self.max_model_len
        if n > m:
            raise bad_request(f"{name} has {n} tokens, more than this model's maximum context length of {m} "
                              "tokens; shorten it or set truncate_prompt_tokens", param)
        config = self.async_engine.config
        if config.model_config.is_encoder:
            try:
                check_whole_prompt(n, config.scheduler_config)
            except ValueError as e:
                raise bad_request(f"{name}: {e}", param) from None
        return p

    def params(self, task: str, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        try:
            params = PoolingParams(task=task, dimensions=dimensions, normalize=normalize)
            self.processor.resolve_pooling(params)
        except ValueError as e:
            raise bad_request(str(e), "dimensions" if "dimensions" in str(e) else None) from None
        return params

    async def run_pooling(self, raw_request: Request | None, prompts: list[EnginePrompt], params: PoolingParams,
                          body: Any, prefix: str) -> list[PoolingRequestOutput] | Response:
        """Every prompt as a pooling request; the outputs in input order (a 499 response when the
        client left meanwhile: its requests are aborted)."""
        self.model_name(body.model)
        call = EngineCall(self.async_engine, random_id(prefix), self.state)
        try:
            return await await_unless_disconnected(  # type: ignore[no-any-return]
                raw_request, self.async_engine, call.start(prompts, params, body.priority, body.user), self.state)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            await call.close()

    # ---- routes ---------------------------------------------------------------------------
    async def embeddings(self, body: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_runner("/v1/embeddings")
        params = self.params("embed", body.dimensions, body.normalize)
        outs = await self.run_pooling(raw_request, self.prompts(body.input, cut=self.truncation(body)), params, body,
                                      "embd")
        if isinstance(outs, Response):
            return outs
        for i, o in enumerate(outs):
            if o.outputs.data.dim() != 1:
                raise bad_request(f"input[{i}] pools to shape {list(o.outputs.data.shape)} (pooling type ALL): use "
                                  "/pooling for per-token states", "input")
        data = [EmbeddingData(index=i, embedding=encode_floats(o.outputs.data, body.encoding_format))
                for i, o in enumerate(outs)]
        return _json(EmbeddingResponse(model=self.model_name(body.model), data=data, usage=_usage(outs)))

    async def pooling_route(self, body: PoolingRequest, raw_request: Request) -> Response:
        self.check_runner("/pooling")
        task = "classify" if is_classifier(self.async_engine.model_config.hf_config) else "embed"
        params = self.params(task, body.dimensions, body.normalize)
        outs = await self.run_pooling(raw_request, self.prompts(body.input, cut=self.truncation(body)), params, body,
                                      "pool")
        if isinstance(outs, Response):
            return outs
        data = [PoolingData(index=i, data=encode_floats(o.outputs.data, body.encoding_format))
                for i, o in enumerate(outs)]
        return _json(PoolingResponse(model=self.model_name(body.model), data=data, usage=_usage(outs)))

    async def scores(self, raw_request: Request, body: Any, pairs: list[tuple[str, str]], param: str
                     ) -> tuple[list[float], int] | Response:
        """(one score per pair, prompt tokens used): a cross-encoder's, or the cosine similarity
        of the two texts' embeddings. With truncation, a cross-encoder's pair is cut as one input,
        an embedding model's texts each."""
        cut = self.truncation(body)
        if is_classifier(self.async_engine.model_config.hf_config):
            prompts = []
            for i, (a, b) in enumerate(pairs):
                if a == "" or b == "":
                    raise bad_request(f"pair {i} has an empty text", param)
                ids = pair_token_ids(self.tokenizer, a, b, *cut)
                prompts.append(self.checked(EnginePrompt(self.processor.tokenize_prompt(ids)[1], None), f"pair {i}",
                                            param))
            outs = await self.run_pooling(raw_request, prompts, self.params("classify"), body, "score")
            if isinstance(outs, Response):
                return outs
            return [float(o.outputs.data[0]) for o in outs], _usage(outs).prompt_tokens
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = [self._prompt(t, f"text {i}", param, cut) for i, t in enumerate(texts)]
        outs = await self.run_pooling(raw_request, prompts, self.params("embed"), body, "score")
        if isinstance(outs, Response):
            return outs
        by_text = {t: o.outputs.data for t, o in zip(texts, outs)}
        return [cosine(by_text[a], by_text[b]) for a, b in pairs], _usage(outs).prompt_tokens

    async def score(self, body: ScoreRequest, raw_request: Request) -> Response:
        self.check_runner("/score")
        try:
            first, second = body.sides()
        except ValueError as e:
            raise bad_request(str(e)) from None
        try:
            pairs = score_pairs(getattr(body, first), getattr(body, second))
        except ValueError as e:
            raise bad_request(f"{first} and {second}: {e}", second) from None
        got = await self.scores(raw_request, body, pairs, second)
        if isinstance(got, Response):
            return got
        values, tokens = got
        data = [ScoreData(index=i, score=s) for i, s in enumerate(values)]
        return _json(ScoreResponse(model=self.model_name(body.model), data=data,
                                   usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def rerank(self, body: RerankRequest, raw_request: Request) -> Response:
        self.check_runner("/rerank")
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        if not documents:
            raise bad_request("documents must not be empty", "documents")
        if body.top_n is not None and body.top_n < 0:
            raise bad_request(f"top_n must be non-negative, got {body.top_n}", "top_n")
        got = await self.scores(raw_request, body, [(body.query, d) for d in documents], "documents")
        if isinstance(got, Response):
            return got
        values, tokens = got
        order = sorted(range(len(values)), key=lambda i: -values[i])
        if body.top_n:
            order = order[: body.top_n]
        results = [RerankResult(index=i, relevance_score=values[i],
                                document=RerankDocument(text=documents[i]) if body.return_documents else None)
                   for i in order]
        return _json(RerankResponse(model=self.model_name(body.model), results=results,
                                    usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))


def _usage(outs: list[PoolingRequestOutput]) -> PoolingUsage:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return PoolingUsage(prompt_tokens=n, total_tokens=n)


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(exclude_none=True), media_type="application/json")


def add_pooling_routes(app: FastAPI, serving: OpenAIServingPooling, count_request: Callable[[str], None]) -> None:
    """The pooling routes; on a pooling server, a 400 for the generation routes."""

    async def handled(coro: Any) -> Response:
        try:
            return await coro
        except OpenAIError as e:
            return error_response(e)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw_request: Request) -> Response:
        count_request("embeddings")
        return await handled(serving.embeddings(body, raw_request))

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, raw_request: Request) -> Response:
        count_request("pooling")
        return await handled(serving.pooling_route(body, raw_request))

    for path in ("/score", "/v1/score"):
        @app.post(path)
        async def create_score(body: ScoreRequest, raw_request: Request) -> Response:
            count_request("score")
            return await handled(serving.score(body, raw_request))

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path)
        async def create_rerank(body: RerankRequest, raw_request: Request) -> Response:
            count_request("rerank")
            return await handled(serving.rerank(body, raw_request))

    if not serving.pooling:
        return
    name = serving.served_model_names[0]

    @app.middleware("http")
    async def pooling_only(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if request.method != "POST" or path not in GENERATION_ROUTES:
            return await call_next(request)
        err = generation_refused(name, path)
        if path == "/v1/messages":  # Anthropic's error shape
            return JSONResponse({"type": "error", "error": {"type": "invalid_request_error", "message": err.message}},
                                status_code=400)
        return error_response(err)
