"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, vLLM's /pooling and
/score, and the Jina / Cohere-shaped /rerank. Requests validate strictly and refuse unknown fields
(HTTP 400 naming them): a pooling request has no field the server could leave unused."""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import ResponseModel, random_id

# One input, or several: a string, a list of strings, token ids, a list of token-id lists.
EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]


class PoolingRequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class EmbeddingRequest(PoolingRequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    priority: int = 0


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's pooler output as it is (per token with pooling type ALL)."""


class ScoreRequest(PoolingRequestModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None
    priority: int = 0


class RerankRequest(PoolingRequestModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    user: str | None = None
    priority: int = 0


class PoolingUsage(ResponseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class ListResponse(ResponseModel):
    """What /v1/embeddings, /pooling and /score answer besides their id and data."""

    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ListResponse):
    id: str = Field(default_factory=lambda: random_id("embd"))
    data: list[EmbeddingData]


class PoolingData(ResponseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Any  # list[float], list[list[float]] or a base64 string


class PoolingResponse(ListResponse):
    id: str = Field(default_factory=lambda: random_id("pool"))
    data: list[PoolingData]


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse):
    id: str = Field(default_factory=lambda: random_id("score"))
    data: list[ScoreData]


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
