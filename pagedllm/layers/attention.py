"""The attention layer: reads the step's metadata and its own slice of the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import PagedAttentionBackend
from pagedllm.attention.metadata import ForwardContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        # Bound by the model runner: [2, num_blocks, block_size, num_kv_heads, head_dim], its
        # forward context and its attention backend.
        self.kv_cache = torch.empty(0)
        self.context: ForwardContext | None = None
        self.backend: PagedAttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Flat q [T, H*D], k/v [T, KVH*D] -> [T, H*D]."""
        md = self.context.get()  # type: ignore[union-attr]
        T = q.shape[0]
        return self.backend.forward(  # type: ignore[union-attr]
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            md,
            self.scale,
        )
