"""Token embedding and the LM head (which may share the embedding's weight), both split by
vocabulary over the tensor-parallel ranks.

The vocabulary is padded to tp * ceil(vocab / tp) rows; rank r holds rows [r * n, (r + 1) * n).
Padding rows stay zero and their logits are cut off after the gather.

Either may keep its rows as codes of the native quantized kernel instead of the dense weight
(:meth:`_VocabShard.use_codes`, ``--quantize-embeddings``; :mod:`pagedllm.quantization.vocab`);
a tied pair then shares one set of codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.linear import dense_linear
from pagedllm.quantization import native as qnative
from pagedllm.quantization.vocab import RowCodes, quantize_rows


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.size)  # ceil: 49152 / 3 -> 16384; 320 / 3 -> 107
        self.start = self.tp.rank * self.rows
        self.dtype = dtype
        self.qlayout: tuple[int, int] | None = None
        """(bits, group) of the codes in buffers qcodes/qscales/qzeros, or None."""
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a vocabulary of "
                             f"{self.vocab_size} x {param.shape[1]}")
        part = loaded[self.start : self.start + self.rows]
        param.data[: part.shape[0]].copy_(part)

    def use_codes(self, rc: RowCodes, keep_weight: bool = False) -> None:
        """Keep the rows as ``rc``'s codes (buffers: a tied module given the same ``rc`` shares
        them), dropping the dense weight unless ``keep_weight``."""
        if not keep_weight and "weight" in self._parameters:
            del self.weight
        for name, t in zip(("qcodes", "qscales", "qzeros"), rc.tensors()):
            self.register_buffer(name, t, persistent=False)
        self.qlayout = (rc.bits, rc.group)

    @property
    def dense(self) -> bool:
        """Whether the dense weight is kept."""
        return "weight" in self._parameters

    @property
    def quant_codes(self) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(bits, group, codes, scales, zeros) in the native kernel's layout, or None."""
        if self.qlayout is None:
            return None
        b = self._buffers
        return (*self.qlayout, b["qcodes"], b["qscales"], b["qzeros"])


class VocabEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = None if self.dense else self.quant_codes
        if q is not None:
            # Only the looked-up rows are expanded; ids another rank holds come out as zero rows.
            bits, _, codes, scales, zeros = q
            out = qnative.gather_rows(codes, scales, zeros, bits, self.rows, ids - self.start, self.dtype)
            return out if self.tp.size == 1 else self.tp.all_reduce(out)
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

    With codes only (:meth:`use_codes`) every call goes through the quantized kernel (decode rows)
    or its batch path. :meth:`keep_codes` adds codes of the weight (int8 per group of 32 inputs, as
    GGUF's Q8_0, or another scheme's) beside the dense weight: decode-sized calls read the codes,
    larger ones the dense weight (which a tied embedding still needs)."""

    def keep_codes(self, method: str = "int8", group_size: int = 128, clip_search: bool = False) -> None:
        """Codes of the weight in ``method``'s layout (pagedllm.quantization.vocab.quantize_rows)
        beside the dense weight."""
        self.use_codes(quantize_rows(self.weight.detach(), method, group_size, clip_search), keep_weight=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q = self.quant_codes
        if q is None:
            y = dense_linear(hidden, self.weight)
        elif not self.dense:
            y = qnative.group_linear(hidden, *q[2:], bits=q[0], n=self.rows)
        else:
            y = qnative.small_m_linear(hidden, *q[2:], bits=q[0], n=self.rows)
            if y is None:
                y = dense_linear(hidden, self.weight)
        logits = y.float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]
