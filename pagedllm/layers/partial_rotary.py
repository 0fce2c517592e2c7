"""RoPE on the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75), and LongRoPE's two
tables (Phi-3, Phi-4-mini).

LongRoPE: the reference rotates with the short factors while the sequence fits in
`original_max_position_embeddings` and with the long factors beyond. The table here holds short
rows below that position and long rows from it on, so a token is rotated by its own position:
the same as the reference when a sequence grows past the limit token by token (its cached keys
keep their short rotation), while a prompt longer than the limit processed in one pass gets short
rows for its first positions where the reference uses long ones throughout.
"""

from __future__ import annotations

import torch

from pagedllm.layers.rotary import RotaryEmbedding


def rope_params(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or {})


def rotary_dim_of(config, head_dim: int) -> int:
    factor = rope_params(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * float(factor))


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rotates dims [0, rotary_dim) of each head (rotate-half within them), passes the rest."""

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        self.rotary_dim = rotary_dim_of(config, head_dim)
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial rotary dimension {self.rotary_dim} of head size {head_dim} "
                             "must be even and between 2 and the head size")
        super().__init__(config, self.rotary_dim, max_position, dtype)
        self.full_head_dim = head_dim
        params = rope_params(config)
        if params.get("rope_type", params.get("type")) == "longrope":
            self._long_rows(config, params, max_position, dtype)

    def _long_rows(self, config, params: dict, max_position: int, dtype: torch.dtype) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        orig = int(params.get("original_max_position_embeddings")
                   or getattr(config, "original_max_position_embeddings", max_position))
        if orig >= max_position:
            return
        with torch.device("cpu"):
            inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=orig + 1)
            t = torch.arange(orig, max_position, dtype=torch.int64).float()
            emb = torch.cat((torch.outer(t, inv_freq.float()),) * 2, dim=-1)
            cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
        self.cos[orig:] = cos.to(self.cos.device)
        self.sin[orig:] = sin.to(self.sin.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rd, hd = self.rotary_dim, self.full_head_dim
        if rd == hd:
            return super().forward(positions, q, k)
        T = q.shape[0]
        q3, k3 = q.reshape(T, -1, hd), k.reshape(T, -1, hd)
        qr, kr = super().forward(positions, q3[..., :rd].reshape(T, -1), k3[..., :rd].reshape(T, -1))
        q = torch.cat((qr.view(T, -1, rd), q3[..., rd:]), dim=-1).view(T, -1)
        k = torch.cat((kr.view(T, -1, rd), k3[..., rd:]), dim=-1).view(T, -1)
        return q, k
