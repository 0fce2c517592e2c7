"""Token embedding and the LM head (which may share the embedding's weight), both split by
vocabulary over the tensor-parallel ranks.

The vocabulary is padded to tp * ceil(vocab / tp) rows; rank r holds rows [r * n, (r + 1) * n).
Padding rows stay zero and their logits are cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.linear import dense_linear
from pagedllm.quantization import native as qnative
from pagedllm.quantization.kernels import quantize_int8_per_channel


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.size)  # ceil: 49152 / 3 -> 16384; 320 / 3 -> 107
        self.start = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a vocabulary of "
                             f"{self.vocab_size} x {param.shape[1]}")
        part = loaded[self.start : self.start + self.rows]
        param.data[: part.shape[0]].copy_(part)


class VocabEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        # Each rank looks up the ids it holds (zeros for the others); the all-reduce fills in the rest.
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class LMHead(_VocabShard):
    """Projects final hidden states of selected tokens to float32 logits over the whole vocabulary.

    :meth:`keep_int8` adds int8 codes of the weight (per group of 32 inputs, as GGUF's Q8_0) that
    decode-sized calls read through the native quantized kernel; larger ones keep the dense weight
    (which a tied embedding still needs)."""

    def keep_int8(self) -> None:
        # Symmetric int8 per group of 32 inputs, each group quantized as an int8 output channel is
        # (which gives Q8_0's codes back where the weight came from Q8_0).
        codes, scales = quantize_int8_per_channel(self.weight.detach().reshape(-1, 32))
        packed, s, z = qnative.pack_int8_native(codes.reshape(self.rows, -1), scales.reshape(self.rows, -1),
                                                torch.zeros(self.rows, scales.numel() // self.rows))
        self.register_buffer("qcodes", packed, persistent=False)
        self.register_buffer("qscales", s, persistent=False)
        self.register_buffer("qzeros", z, persistent=False)

    @property
    def int8_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, scales, zeros) in the native kernel's layout after :meth:`keep_int8`, else None."""
        b = self._buffers
        return (b["qcodes"], b["qscales"], b["qzeros"]) if "qcodes" in b else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        codes = self.int8_codes
        y = None if codes is None else qnative.small_m_linear(hidden, *codes, bits=8, n=self.rows)
        logits = (y if y is not None else dense_linear(hidden, self.weight)).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]
