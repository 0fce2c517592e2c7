"""pagedllm: an LLM inference and serving engine with a paged KV cache and continuous batching."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# GNU OpenMP (torch's CPU threads and the native kernels) lets a thread that waits at a barrier
# spin 300,000 pause instructions (about 16 ms on a Xeon) before it sleeps. When another process
# wants a core (a chat client, the server's front end, a neighbour), a thread spinning for a
# descheduled teammate keeps that core from everyone: measured with guidellm's 16 chat streams on
# the same 2 cores, prompt steps took 1.0-1.5 s instead of 0.25 s and the mean time to first token
# was 1.16 s. 10,000 spins (about 0.5 ms) keep every uncontended figure (offline throughput, one
# stream's decode) and bring that mean to 0.69 s (docs/architecture.md, "Threads"). libgomp reads
# the variable once, when it loads, so it is set here, before anything imports torch; a value the
# user sets wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
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
