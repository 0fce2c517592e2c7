"""Activations on fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.native_elementwise import silu_mul_bf16


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is the fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = silu_mul_bf16(x)  # bf16 and float32 on the CPU: one fused pass
        if y is not None:
            return y
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
