"""Decoder embedding models: a Llama/Qwen-family decoder without its LM head (`Qwen3Model`,
`LlamaModel`, ...), whose final normed hidden states the pooler reads (LAST pooling by default,
as Qwen3-Embedding does)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def decoder_embedding_model(cls: type[nn.Module], name: str) -> type[nn.Module]:
    """`cls` (a *ForCausalLM class) without its LM head, registered as architecture `name`."""

    class DecoderEmbedding(cls):  # type: ignore[valid-type, misc]
        pooling_only = True

        def __init__(self, config, dtype: torch.dtype = torch.float32, parallel=None, quant_config=None) -> None:
            super().__init__(config, dtype, parallel, quant_config)
            if hasattr(self, "lm_head"):
                del self.lm_head

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            raise ValueError(f"{name} has no LM head: it pools (serve it with --runner pooling)")

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return super().load_weights((n, t) for n, t in weights if not n.startswith("lm_head."))

    DecoderEmbedding.__name__ = DecoderEmbedding.__qualname__ = name
    return DecoderEmbedding
