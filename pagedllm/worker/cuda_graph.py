"""Decode-only steps replayed from CUDA graphs, one graph per padded batch size, captured at start.

A decode step of n requests (one token each) pads to the smallest captured size B >= n. The
graph reads its inputs from static buffers, which each step overwrites in place:

    n = 3, B = 4: input_ids [t0, t1, t2, stale], slot_mapping [s0, s1, s2, -1],
                  seq_lens [l0, l1, l2, 0], work rows (i, 0, 1) for i < 4 (fixed),
                  query_start_loc [0, 1, 2, 3, 4] (fixed)

A padding row writes no K/V (slot -1) and attends to nothing (sequence length 0); its stale
token and position only feed its own discarded output row. Sampling stays outside the graph.

With LoRA on the Triton kernels (lora/triton_lora.py) the graphs hold their launches too, reading
each row's adapter from one more static buffer: the step's rows ordered by slot (lora.layers.
slot_order), written before every replay (no rows for a step without adapters, and a padding row
is never among them). The kernels' grid depends on the padded size only, and the adapters' slots
are preallocated tensors that loading an adapter overwrites in place, so the graphs captured at
start stay valid as adapters come and go.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, ForwardContext
from pagedllm.lora.layers import LoRAStep, slot_order
from pagedllm.worker.input_batch import BatchArrays

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        sliding_window: int,
        num_splits: dict[int, int],
        device: torch.device,
        context: ForwardContext,
        lora: Any = None,
    ) -> None:
        self.model = model
        self.context = context
        self.sizes = sorted(set(sizes))
        self.sliding_window = sliding_window
        self.num_splits = num_splits
        n = self.sizes[-1]
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.zeros(n, **i64)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i64)
        self.query_start_loc = torch.arange(n + 1, **i64)
        self.work = torch.stack([torch.arange(n, **i64), torch.zeros(n, **i64), torch.ones(n, **i64)], dim=1)
        # With `lora` (the LoRA manager, on the Triton kernels): its step reads slot_order's view of
        # the rows from a static buffer.
        self.lora: LoRAStep | None = lora.step if lora is not None else None
        self.num_lora_slots = lora.config.max_loras if lora is not None else 0
        self.lora_order = (torch.zeros(self.num_lora_slots + 1 + n, dtype=torch.int32, device=device)
                           if lora is not None else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=b,
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            work=self.work[:b],
            sliding_window=self.sliding_window,
            triton=True,
            max_query_len=1,
            num_splits=self.num_splits.get(b, 1),
        )

    def _forward(self, b: int) -> torch.Tensor:
        lora = self.lora
        if lora is not None:  # the kernels read the static order, over a grid for b rows
            lora.groups, lora.slots = (), None
            lora.order, lora.order_rows = self.lora_order[: self.num_lora_slots + 1 + b], b
        with self.context.set(self._metadata(b)):
            return self.model(self.input_ids[:b], self.positions[:b])

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures every size, largest first (later graphs reuse the first one's memory pool)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._forward(b)  # compiles the kernels of this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        elapsed = self.capture_seconds = time.perf_counter() - t0
        logger.info("Captured %d CUDA graphs for decode batch sizes %s in %.2f s", len(self.sizes), self.sizes, elapsed)
        return elapsed

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size that holds n decode tokens, or None."""
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def run(self, batch: BatchArrays, lora_slots: np.ndarray | None = None) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode-only batch, or None when no graph fits it.
        `lora_slots`: each row's adapter slot (-1: none), for graphs captured with LoRA."""
        n = len(batch.input_ids)
        b = self.padded_size(n)
        if b is None or n != len(batch.seq_lens):
            return None
        width = batch.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None

        def put(dst: torch.Tensor, src: np.ndarray) -> None:
            dst.copy_(torch.from_numpy(src), non_blocking=True)

        put(self.input_ids[:n], batch.input_ids)
        put(self.positions[:n], batch.positions)
        put(self.slot_mapping[:n], batch.slot_mapping)
        put(self.seq_lens[:n], batch.seq_lens)
        put(self.block_tables[:n, :width], batch.block_tables)
        if b > n:
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(0)
        if self.lora_order is not None:
            s = self.num_lora_slots + 1
            if lora_slots is None:
                self.lora_order[:s].fill_(0)  # no rows for any slot
            else:
                order, _ = slot_order(lora_slots, self.num_lora_slots)
                put(self.lora_order[: s + n], order)
        elif lora_slots is not None:
            raise ValueError("a step with LoRA rows on CUDA graphs captured without LoRA")
        self.graphs[b].replay()
        return self.outputs[b][:n]
