"""Gemma's RMSNorm: the weight is stored as an offset from one, `x * rsqrt(mean(x^2) + eps) * (1 + w)`,
computed in float32 and cast back to the input's dtype at the end (Gemma 3 casts after the scale,
Llama's RMSNorm before it)."""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """Over the last dimension: the hidden size, or one head's size for Gemma 3's q_norm / k_norm."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
