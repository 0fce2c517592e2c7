"""The torch forward pass: the model's modules run one by one, attention through the runner's backend."""

from __future__ import annotations

from typing import Any

import dataclasses

import numpy as np
import torch

from pagedllm.attention.backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionGroup, AttentionMetadata, DenseAttention, ForwardContext
from pagedllm.config import ModelConfig
from pagedllm.worker import device as dev
from pagedllm.worker.forward.base import ForwardPath, PreparedStep
from pagedllm.worker.input_batch import BatchArrays


class EagerPath(ForwardPath):
    """Every step no other path takes: the batch's arrays to the device, the attention metadata
    installed in the forward context, the model called on the token ids and positions."""

    name = "eager"

    def __init__(self, model: torch.nn.Module, context: ForwardContext, backend: Any, device: torch.device,
                 model_config: ModelConfig) -> None:
        self.model = model
        self.context = context
        self.device = device
        self.native = backend.native
        self.sliding_window = model_config.sliding_window or 0
        self.num_kv_heads = model_config.num_kv_heads
        self.triton = isinstance(backend, TritonAttentionBackend)
        if self.triton:
            from pagedllm.attention.triton_attention import choose_num_splits

            self._num_splits = choose_num_splits
            self._sms = dev.num_sms(device) if device.type == "cuda" else dev.INTERPRETER_SMS

    # The fused decode step's StallGuard (ForwardPaths sets it where that step exists): while it
    # runs decode steps on one thread because another process holds a core, prompt steps run on
    # one thread too. A team of torch threads waits at every op for the descheduled one: a
    # 350-token prompt's first token took 0.9-1.9 s beside one busy process, 0.1 s alone.
    guard: Any = None

    def run(self, step: PreparedStep) -> torch.Tensor:
        if self.guard is None or not self.guard.stalled():
            return self.forward(step.batch)
        team = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.forward(step.batch)
        finally:
            torch.set_num_threads(team)

    def forward(self, batch: BatchArrays) -> torch.Tensor:
        """The final hidden states of the batch's tokens."""
        with self.context.set(self.metadata(batch)):
            return self.model(*self.inputs(batch))

    def inputs(self, batch: BatchArrays) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids and positions on the device."""
        ids = torch.from_numpy(batch.input_ids).to(self.device, non_blocking=True)
        return ids, torch.from_numpy(batch.positions).to(self.device, non_blocking=True)

    def metadata(self, batch: BatchArrays) -> AttentionMetadata:
        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        groups = [
            AttentionGroup(
                batch_size=g.batch_size,
                max_query_len=g.max_query_len,
                query_index=t(g.query_index),
                out_rows=t(g.out_rows),
                out_dest=t(g.out_dest),
                block_tables=t(g.block_tables),
                mask=t(g.mask),
            )
            for g in batch.groups
        ]
        md = AttentionMetadata(
            num_tokens=len(batch.input_ids),
            slot_mapping=t(batch.slot_mapping),
            block_tables=t(batch.block_tables),
            query_start_loc=t(batch.query_start_loc),
            seq_lens=t(batch.seq_lens),
            work=t(batch.work),
            sliding_window=self.sliding_window,
            groups=groups,
            native=self.native,
            dense=[
                DenseAttention(d.query_start, d.query_len, t(d.blocks), d.seq_len)
                for d in batch.dense
            ],
            **self._triton_fields(batch),
        )
        md.kv_groups = [
            dataclasses.replace(
                md,
                slot_mapping=t(kg.slot_mapping),
                block_tables=t(kg.block_tables),
                groups=[dataclasses.replace(g, block_tables=t(bt)) for g, bt in zip(groups, kg.group_block_tables)],
                dense=[dataclasses.replace(d, blocks=t(b)) for d, b in zip(md.dense, kg.dense_blocks)],
                windows={},
                kv_groups=[],
            )
            for kg in batch.kv_groups
        ]
        return md

    def _triton_fields(self, batch: BatchArrays) -> dict[str, int]:
        """Launch shape of the Triton kernel: longest work item, key-range splits."""
        if not self.triton:
            return {}
        counts = batch.work[:, 2]
        max_seq = int(batch.seq_lens.max()) if len(batch.seq_lens) else 0
        splits = self._num_splits(len(counts), self.num_kv_heads, max_seq, self._sms)
        return {"max_query_len": int(counts.max()) if len(counts) else 0, "num_splits": splits, "triton": True}
