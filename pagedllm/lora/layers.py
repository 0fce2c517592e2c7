"""The batched LoRA linear method: the base layer's one GEMM for the whole batch, then for the
rows of each adapter in the step x A^T B^T (shrink to the slot's rank, expand to the outputs; the
scale is folded into B), from the adapter's slot in the layer's preallocated stacks.

The step's rows are grouped by slot once per step (`LoRAStep`), not per layer; a step without
adapter rows costs every layer one empty-tuple test. On a row-parallel layer the delta is added
to the rank's partial product, before the layer's all-reduce."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.layers.linear import Linear, dense_linear


@dataclass
class LoRAStep:
    """This step's adapter rows: (slot, rows) per adapter in the batch, rows a slice where its
    tokens are contiguous, else an index tensor. Empty: no adapter rows this step."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...] = ()


class LoRALinearMethod:
    """Wraps a linear layer's method (unquantized or quantized) with the adapters' deltas."""

    def __init__(self, base: Any, layer: Linear, step: LoRAStep, num_slots: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        from pagedllm.lora.layout import slice_ids

        self.base_method = base
        self.step = step
        n = len(slice_ids(layer)) * max_rank
        device = next((t.device for t in layer.buffers()), None) or next(
            (p.device for p in layer.parameters()), torch.device("cpu"))
        self.lora_a = torch.zeros(num_slots, n, layer.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, layer.out_features, n, dtype=dtype, device=device)

    def __getattr__(self, name: str) -> Any:
        # The base method's attributes (its name, its kernel flags) read through the wrapper.
        if name == "base_method":
            raise AttributeError(name)
        return getattr(self.base_method, name)

    def set_slot(self, slot: int, pieces: list[Any] | None) -> None:
        """Fills a slot with an adapter's pieces for this layer (layout.Piece), zeros elsewhere."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for p in pieces or ():
            r, rows = p.lora_a.shape[0], p.lora_b.shape[0]
            a[p.col : p.col + r].copy_(p.lora_a)
            b[p.start : p.start + rows, p.col : p.col + r].copy_(p.lora_b)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base_method.apply(layer, x, bias)
        groups = self.step.groups
        if not groups:
            return y
        dtype = self.lora_a.dtype
        for slot, rows in groups:
            d = dense_linear(dense_linear(x[rows].to(dtype), self.lora_a[slot]), self.lora_b[slot]).to(y.dtype)
            if isinstance(rows, slice):
                y[rows] += d
            else:
                y.index_add_(0, rows, d)
        return y
