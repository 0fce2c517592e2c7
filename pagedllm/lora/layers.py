"""The batched LoRA linear method: the base layer's one GEMM for the whole batch, then for the
rows of each adapter in the step x A^T B^T (shrink to the slot's rank, expand to the outputs; the
scale is folded into B), from the adapter's slot in the layer's preallocated stacks.

The step's rows are grouped by slot once per step (`LoRAStep`), not per layer: where the native
kernel applies (the CPU, float32 or bfloat16) every adapter row, decodes and prompt chunks alike,
goes through one native call per layer for all of them (native/csrc/lora.c); on a GPU (or with
the Triton attention backend) through two Triton launches per layer for all of them, shrink and
expand (lora/triton_lora.py, the rows ordered by slot: `slot_order`); elsewhere each adapter's
rows take two torch GEMMs. A step without adapter rows
costs every layer two attribute tests. On a row-parallel layer the delta is added to the rank's
partial product, before the layer's all-reduce."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from pagedllm import native
from pagedllm.layers.linear import WIDENED_DTYPES, Linear, dense_linear
from pagedllm.native import kernels

_DT = {torch.float32: 0, torch.bfloat16: 1}


@lru_cache(maxsize=1)
def lora_kernel() -> Any:
    """The bound LoRA kernel (native/csrc/lora.c), or None (PAGEDLLM_NATIVE_LORA=0, no compiler)."""
    return native.load(kernels.LORA)


@lru_cache(maxsize=1)
def lora_amx() -> bool:
    """Whether the native kernel runs bf16 deltas on AMX tiles here (lora_amx.h)."""
    kernel = lora_kernel()
    return kernel is not None and bool(kernel.lora_amx_available())


def pack_a_tiles(a: torch.Tensor) -> torch.Tensor:
    """A slot's A [n, K] in the AMX tiles' layout (lora_amx.h's ap): [K/32, ceil(n/16), 16, 16, 2]."""
    n, k = a.shape
    pad = torch.zeros(-(-n // 16) * 16, k, dtype=a.dtype, device=a.device)
    pad[:n] = a
    return pad.view(-1, 16, k // 32, 16, 2).permute(2, 0, 3, 1, 4).reshape(-1)


def pack_bt_tiles(bt: torch.Tensor, num_slices: int, rank: int) -> torch.Tensor:
    """A slot's B^T [num_slices * R, N] in the AMX tiles' layout (lora_amx.h's bp): per slice,
    blocks of 16 columns of ranks padded to RP, kk ranks (16 or 32) a tile, as pairs."""
    n, cols = bt.shape
    kk = 16 if rank <= 16 else 32
    rp = -(-rank // kk) * kk
    pad = torch.zeros(num_slices, rp, -(-cols // 16) * 16, dtype=bt.dtype, device=bt.device)
    pad[:, :rank, :cols] = bt.view(num_slices, rank, cols)
    return pad.view(num_slices, rp // kk, kk // 2, 2, -1, 16).permute(0, 4, 1, 2, 5, 3).reshape(-1)


@dataclass
class LoRAStep:
    """This step's adapter rows: `groups` (slot, rows) for adapters with many rows, rows a slice
    where its tokens are contiguous, else an index tensor; `slots` the slot of every token for
    the native call (-1: none, or in `groups`), None when no row takes it; `failed` the requests
    whose adapter could not be read this step (req_id -> error), which run without it and fail."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...] = ()
    slots: torch.Tensor | None = None
    failed: dict[str, str] = field(default_factory=dict)
    token_slots: np.ndarray | None = None
    """Every token row's slot (int32, -1: none), for the fused native decode step."""
    order: torch.Tensor | None = None
    """For the Triton kernels: the rows with an adapter ordered by slot (`slot_order`), on the
    model's device, None when no row takes them."""
    order_rows: int = 0
    """With `order`: a bound on any one slot's rows (the kernels' grid)."""

    @property
    def active(self) -> bool:
        return bool(self.groups) or self.slots is not None or self.order is not None


def slot_order(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, int]:
    """The Triton kernels' view of a step's rows (triton_lora.py): int32 [starts of each slot's
    rows (num_slots + 1) | the rows with a slot, ordered by slot, in row order within one, then
    zeros for the rows without], and the most rows any slot has."""
    n = len(token_slots)
    out = np.zeros(num_slots + 1 + n, dtype=np.int32)
    counts = np.bincount(token_slots[token_slots >= 0], minlength=num_slots)
    if len(counts) > num_slots:
        raise ValueError(f"LoRA slot {len(counts) - 1} is past the {num_slots} slots")
    out[0] = 0
    np.cumsum(counts, out=out[1 : num_slots + 1])
    order = np.argsort(token_slots, kind="stable")
    taken = order[n - int(out[num_slots]):]
    out[num_slots + 1 : num_slots + 1 + len(taken)] = taken
    return out, int(counts.max()) if len(counts) else 0


def _expand(h: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """h [rows, n] @ B^T [n, out]: in float32 where the CPU has no dot products in h's dtype."""
    if h.dtype in WIDENED_DTYPES and h.device.type == "cpu":
        return torch.mm(h.float(), bt.float()).to(h.dtype)
    return torch.mm(h, bt)


class LoRALinearMethod:
    """Wraps a linear layer's method (unquantized or quantized) with the adapters' deltas."""

    def __init__(self, base: Any, layer: Linear, step: LoRAStep, num_slots: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        from pagedllm.lora.layout import slice_ids

        self.base_method = base
        self.step = step
        slices = slice_ids(layer)
        self.max_rank = max_rank
        # Each slice's output columns [first, one past the last] (block-diagonal B: the native expand's bounds).
        n = len(slices) * max_rank
        device = next((t.device for t in layer.buffers()), None) or next(
            (p.device for p in layer.parameters()), torch.device("cpu"))
        # On the layer's device: the CPU kernels read it there, the Triton kernels on the GPU.
        self.ranges = torch.tensor([[s, s + n] for s, n in map(layer.shard_offsets, slices)], dtype=torch.int64,
                                   device=device)
        self.lora_a = torch.zeros(num_slots, n, layer.in_features, dtype=dtype, device=device)
        self.lora_bt = torch.zeros(num_slots, n, layer.out_features, dtype=dtype, device=device)  # B transposed
        # The same slots in the AMX tiles' layout, where the native kernel runs bf16 deltas on them.
        self.lora_ap = self.lora_bp = None
        if dtype == torch.bfloat16 and device.type == "cpu" and layer.in_features % 32 == 0 and lora_amx():
            self.lora_ap = torch.stack([pack_a_tiles(a) for a in self.lora_a])
            self.lora_bp = torch.stack([pack_bt_tiles(bt, len(slices), max_rank) for bt in self.lora_bt])

    def __getattr__(self, name: str) -> Any:
        # The base method's attributes (its name, its kernel flags) read through the wrapper.
        if name == "base_method":
            raise AttributeError(name)
        return getattr(self.base_method, name)

    def set_slot(self, slot: int, pieces: list[Any] | None) -> None:
        """Fills a slot with an adapter's pieces for this layer (layout.Piece), zeros elsewhere."""
        a, bt = self.lora_a[slot], self.lora_bt[slot]
        a.zero_()
        bt.zero_()
        for p in pieces or ():
            r, rows = p.lora_a.shape[0], p.lora_b.shape[0]
            a[p.col : p.col + r].copy_(p.lora_a)
            bt[p.col : p.col + r, p.start : p.start + rows].copy_(p.lora_b.t())
        if self.lora_ap is not None:
            self.lora_ap[slot] = pack_a_tiles(a)
            self.lora_bp[slot] = pack_bt_tiles(bt, len(self.ranges), self.max_rank)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base_method.apply(layer, x, bias)
        step = self.step
        if step.slots is not None:
            self._native(x, y, step.slots)
        if step.order is not None:
            self._triton(x, y, step.order, step.order_rows)
        for slot, rows in step.groups:
            h = dense_linear(x[rows].to(self.lora_a.dtype), self.lora_a[slot])
            d = _expand(h, self.lora_bt[slot]).to(y.dtype)
            if isinstance(rows, slice):
                y[rows] += d
            else:
                y.index_add_(0, rows, d)
        return y

    def _triton(self, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, rows: int) -> None:
        from pagedllm.lora.triton_lora import lora_shrink_expand

        if order.device != x.device:
            raise ValueError(f"the LoRA step's slot order is on {order.device}, the layer's input on {x.device}")
        lora_shrink_expand(x, y, self.lora_a, self.lora_bt, self.ranges, self.max_rank, order, rows)

    def _native(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> None:
        if x.stride(-1) != 1:
            x = x.contiguous()
        a, bt, ap, bp = self.lora_a, self.lora_bt, self.lora_ap, self.lora_bp
        rc = lora_kernel().lora_sgmv(
            x.data_ptr(), x.stride(0), _DT[x.dtype], x.shape[0], slots.data_ptr(), a.data_ptr(), bt.data_ptr(),
            None if ap is None else ap.data_ptr(), None if bp is None else bp.data_ptr(), _DT[a.dtype], len(self.ranges), self.max_rank, self.ranges.data_ptr(), a.shape[2], bt.shape[2],
            y.data_ptr(), y.stride(0), _DT[y.dtype])
        if rc:
            raise RuntimeError(f"lora_sgmv failed ({rc})")
