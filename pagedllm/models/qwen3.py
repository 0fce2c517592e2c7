"""Qwen3 (dense): the Llama layout with an RMSNorm over each query and key head before RoPE
(`q_norm`, `k_norm`, weights of one head's size), no q/k/v bias, `head_dim` from the config."""

from __future__ import annotations

import torch

from pagedllm.layers.rmsnorm import RMSNorm
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class QKNormAttention(LlamaAttention):
    """Attention whose queries and keys go through RMSNorm(head_dim), head by head, before RoPE."""

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, *args, **kwargs) -> None:
        super().__init__(config, layer_idx, dtype, *args, **kwargs)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        T, d = q.shape[0], self.head_dim
        q = self.q_norm(q.reshape(-1, d)).view(T, -1)
        k = self.k_norm(k.reshape(-1, d)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
