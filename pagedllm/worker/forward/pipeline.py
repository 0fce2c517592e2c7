"""Pipeline-parallel steps: the requests cut into micro-batches that the stages work on at once."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.worker.forward.base import ForwardPath, PreparedStep
from pagedllm.worker.forward.eager import EagerPath
from pagedllm.worker.input_batch import InputBatch


def micro_batches(counts: list[int], n: int) -> list[tuple[int, int]]:
    """Cuts requests into at most n contiguous runs of about equal tokens, as [start, end) indices.

    counts [4, 1, 1, 1, 1], n 2 -> total 8, cut once 4 tokens are reached -> [(0, 1), (1, 5)].
    """
    total = sum(counts)
    bounds, start, acc = [], 0, 0
    for i, c in enumerate(counts):
        acc += c
        if acc * n >= total * (len(bounds) + 1) and i + 1 < len(counts) and len(bounds) + 1 < n:
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(counts)))
    return bounds


class PipelinePath(ForwardPath):
    """Every step of a rank with pipeline stages: this stage's layers over up to pp_size
    micro-batches of about equal tokens. Each stage sends a micro-batch on as soon as it is done
    and starts the next, so the stages work at the same time (stage 0 on micro-batch 1 while
    stage 1 runs micro-batch 0). The last stage concatenates them back into the batch's row order
    and returns them; the other stages return None."""

    name = "pipeline"

    def __init__(self, eager: EagerPath, parallel: ParallelContext, input_batch: InputBatch,
                 sliding_window: int | None, batch_options: dict[str, Any], hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.eager = eager
        self.parallel = parallel
        self.input_batch = input_batch
        self.sliding_window = sliding_window
        self.batch_options = batch_options  # the runner's dict: later changes to it apply
        self.hidden_size = hidden_size
        self.dtype = dtype

    def run(self, step: PreparedStep) -> torch.Tensor | None:
        p, eager = self.parallel, self.eager
        rows, counts, batch = step.rows, step.counts, step.batch
        outs, sends = [], []
        for a, b in micro_batches(counts.tolist(), p.pp_size):
            mb = batch if (a, b) == (0, len(counts)) else self.input_batch.prepare(
                rows[a:b], counts[a:b], self.sliding_window, **self.batch_options)
            h_in = None
            if not p.is_first_stage:
                h_in = p.recv_from_prev_stage([(len(mb.input_ids), self.hidden_size)], self.dtype)[0]
            with eager.context.set(eager.metadata(mb)):
                h = eager.model(*eager.inputs(mb), h_in)
            if p.is_last_stage:
                outs.append(h)
            else:
                sends.append((h, p.send_to_next_stage([h])))
        for _, works in sends:
            for w in works:
                w.wait()
        return torch.cat(outs) if outs else None
