"""RMSNorm, computed in float32 like the reference implementation (bf16 on the CPU: one fused
native pass with the same rounding points; the residual add and the norm in one native pass in
bf16 and float32, pagedllm/layers/native_elementwise.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.native_elementwise import rms_norm_bf16


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm.attention.triton_fused import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same numbers
        fused = rms_norm_bf16(x, self.weight, self.eps)
        if fused is not None:
            return fused[1]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_and_norm(self, x: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = x + add (the residual stream and the next sublayer's input)."""
        if not x.is_cuda:
            fused = rms_norm_bf16(x, self.weight, self.eps, add)
            if fused is not None:
                return fused
        h = x + add
        return h, self(h)
