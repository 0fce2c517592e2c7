"""What generation returns, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top alternatives).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    priority: int = 0
    extra: dict = field(default_factory=dict)


# ---- pooling (embeddings, classification, scores), with vLLM's class and field names ----------


@dataclass
class PoolingOutput:
    """A pooling request's raw result: a float32 tensor ([dims], or [tokens, hidden] for ALL)."""

    data: Any  # torch.Tensor

    @classmethod
    def from_bytes(cls, shape: list[int], data: bytes) -> PoolingOutput:
        import torch

        return cls(torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape))


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput, or the task's view of it (EmbeddingOutput, ClassificationOutput, ...)
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    def with_outputs(self, cls: type, outputs: Any) -> Any:
        """This request's output as `cls` (a PoolingRequestOutput subclass) carrying `outputs`."""
        return cls(self.request_id, outputs, self.prompt_token_ids, self.finished, self.prompt,
                   self.num_cached_tokens, self.metrics)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        data = output.data
        if data.dim() != 1:
            raise ValueError(f"an embedding is one vector; this output has shape {list(data.shape)} (pooling ALL)")
        return cls(data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return out.with_outputs(cls, EmbeddingOutput.from_base(out.outputs))


@dataclass
class ClassificationOutput:
    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return out.with_outputs(cls, ClassificationOutput.from_base(out.outputs))


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """One (text_1, text_2) pair's score: a cross-encoder's activated logit, or the cosine
    similarity of the two texts' embeddings."""
