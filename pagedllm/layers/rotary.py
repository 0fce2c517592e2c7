"""Rotary position embedding with a precomputed cos/sin cache, indexed by each token's position.

Scaled variants (linear, dynamic, yarn, llama3, longrope) take their inverse frequencies from
transformers' own RoPE initializers, so the numbers match the reference implementation.
"""

from __future__ import annotations

import torch
from torch import nn


def _inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE in the rotate-half (GPT-NeoX) layout to flat [num_tokens, heads * head_dim] q/k."""

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = _inv_freq(config, head_dim)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_position, head_dim] each, in the model dtype (as the reference casts before use).
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x.view(n, -1, self.head_dim)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).view(n, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
