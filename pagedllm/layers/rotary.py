"""Rotary position embedding with a precomputed cos/sin cache, indexed by each token's position.

Scaled variants (linear, dynamic, yarn, llama3, longrope) take their inverse frequencies from
transformers' own RoPE initializers, so the numbers match the reference implementation.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.native_elementwise import rope_bf16


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


def _cos_sin(config, head_dim: int, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_position, head_dim] cos and sin, computed on the CPU whatever the model's device (the
    table is exact there), then moved to where the model is being built."""
    device = torch.empty(0).device  # the torch.device context the model is built under
    with torch.device("cpu"):
        inv_freq, scaling = _inv_freq(config, head_dim)
        t = torch.arange(max_position, dtype=torch.int64).float()
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        # In the model dtype, as the reference casts them before use.
        cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    return cos.to(device), sin.to(device)


class RotaryEmbedding(nn.Module):
    """Applies RoPE in the rotate-half (GPT-NeoX) layout to flat [num_tokens, heads * head_dim] q/k.

    A model builds one instance and shares it between its layers: the tables and the per-pass
    lookup belong to that model, never to the module (two engines in one process share nothing).
    """

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        cos, sin = _cos_sin(config, head_dim, max_position, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # (positions, cos rows, sin rows) of the current forward pass.
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x.view(n, -1, self.head_dim)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).view(n, -1)

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer sees the same positions tensor in a forward pass: look up once, reuse.
        # The memo holds `positions` itself, so its identity cannot be recycled while memoized.
        memo = self._memo
        if memo is None or memo[0] is not positions:
            cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, head_dim]
            sin = self.sin.index_select(0, positions).unsqueeze(1)
            memo = self._memo = (positions, cos, sin)
        return memo[1], memo[2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:
            from pagedllm.attention.triton_fused import rotary

            return rotary(positions, q, k, self.cos, self.sin, self.head_dim)
        qw = q.shape[1]
        # bf16 and float32: one fused native pass (bf16 with the same rounding points)
        native = q.dtype in (torch.bfloat16, torch.float32)
        if (q.dim() == 2 and k.dim() == 2 and q.stride() == k.stride() and q.stride(1) == 1
                and k.data_ptr() == q.data_ptr() + qw * q.element_size()):
            # q and k side by side in one row (the fused QKV output): rotate both in one pass.
            qk = q.as_strided((q.shape[0], qw + k.shape[1]), q.stride())
            out = rope_bf16(qk, positions, self.cos, self.sin, self.head_dim) if native else None
            if out is None:
                out = self._rotate(qk, *self._lookup(positions))
            return out[:, :qw], out[:, qw:]
        if native:
            qo = rope_bf16(q, positions, self.cos, self.sin, self.head_dim)
            ko = rope_bf16(k, positions, self.cos, self.sin, self.head_dim) if qo is not None else None
            if ko is not None:
                return qo, ko
        cos, sin = self._lookup(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
