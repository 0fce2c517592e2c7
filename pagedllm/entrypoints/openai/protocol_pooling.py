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


class TruncationFields(PoolingRequestModel):
    """vLLM's truncation: keep `truncate_prompt_tokens` tokens of each input (-1: the model's
    context), from the `truncation_side` given, else as the tokenizer truncates (llm_pooling.py)."""

    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None


class EmbeddingRequest(TruncationFields):
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


# vLLM's names for the two sides of /score, each pair one request shape.
SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))


class ScoreRequest(TruncationFields):
    """vLLM's /score: the two sides as `text_1`/`text_2`, `data_1`/`data_2`, `queries`/`documents`
    or `queries`/`items` (one text or a list each)."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    user: str | None = None
    priority: int = 0

    def sides(self) -> tuple[str, str]:
        """The names of the two fields this request gives; ValueError unless it gives exactly one pair."""
        given = [name for name in ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")
                 if getattr(self, name) is not None]
        for pair in SCORE_SIDES:
            if sorted(given) == sorted(pair):
                return pair
        shapes = ", ".join(f"{a}/{b}" for a, b in SCORE_SIDES)
        raise ValueError(f"give the two sides to score as one of {shapes}; got {', '.join(given) or 'none'}")


class RerankRequest(TruncationFields):
    model: str | None = None
    query: str
    documents: str | list[str]
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
