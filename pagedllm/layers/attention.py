"""The attention layer: reads the step's metadata and its own slice of the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import get_attention_metadata
from pagedllm.attention.torch_backend import paged_attention


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        # [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the model runner.
        self.kv_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Flat q [T, H*D], k/v [T, KVH*D] -> [T, H*D]."""
        md = get_attention_metadata()
        T = q.shape[0]
        q3 = q.view(T, self.num_heads, self.head_dim)
        k3 = k.view(T, self.num_kv_heads, self.head_dim)
        v3 = v.view(T, self.num_kv_heads, self.head_dim)
        if md.triton:
            from pagedllm.attention.triton_attention import forward

            scales = float(getattr(self, "k_scale", 1.0)), float(getattr(self, "v_scale", 1.0))
            return forward(q3, k3, v3, self.kv_cache, md, self.scale, *scales)
        return paged_attention(q3, k3, v3, self.kv_cache, md, self.scale)
