"""Decode-only steps replayed from the CUDA graphs captured at start (worker/cuda_graph.py)."""

from __future__ import annotations

import torch

from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.forward.base import ForwardPath, PathSelector, PreparedStep


class CudaGraphPath(ForwardPath):
    """Every step of a rank with captured graphs: a decode-only step that a graph holds replays
    it; any other (a prompt chunk, more rows than the largest graph, a block table wider than
    the graphs' buffers) runs on the path `fallback` selects for it. With `lora` (graphs captured
    with the Triton LoRA kernels) steps with adapter rows replay too."""

    name = "cuda_graph"

    def __init__(self, graphs: CudaGraphRunner, fallback: PathSelector) -> None:
        self.graphs = graphs
        self.fallback = fallback
        self.lora = graphs.lora is not None

    def run(self, step: PreparedStep) -> torch.Tensor | None:
        hidden = self.graphs.run(step.batch, step.lora_slots) if step.lora else self.graphs.run(step.batch)
        return self.fallback.select_path(step).run(step) if hidden is None else hidden
