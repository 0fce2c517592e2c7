"""pagedllm: an LLM inference and serving engine with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineArgs", "LLMEngine",
           "LoRARequest", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput", "ScoringRequestOutput",
           "__version__"]

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.llm import LLM
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling_params",
    "PoolingRequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "LoRARequest": "pagedllm.lora.request",
}


def __getattr__(name: str) -> Any:
    # Imported on first use so that `pagedllm.core` stays importable without torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
