"""A step's forward pass, one of several paths, chosen once per step by ForwardPaths.select_path.

    path            runs                                              returns
    eager           the model's torch modules                          hidden states
    native_decode   a small decode-only step as one native call (CPU)  hidden states
    native_head     the same call on through the LM head (and argmax)  logits, or greedy token ids
    cuda_graph      a decode-only step replayed from a captured graph  hidden states
    pipeline        this stage's layers over micro-batches (pp > 1)    hidden states (last stage)

The runner builds the paths once its model is loaded, and again when its native decode step or
its CUDA graphs change; a step costs one select_path call and the chosen path's run.
"""

from __future__ import annotations

from pagedllm.worker.forward.base import ForwardPath, PreparedStep
from pagedllm.worker.forward.eager import EagerPath
from pagedllm.worker.forward.graph import CudaGraphPath
from pagedllm.worker.forward.native import NativeDecodePath, NativeHeadPath
from pagedllm.worker.forward.pipeline import PipelinePath, micro_batches

__all__ = [
    "CudaGraphPath", "EagerPath", "ForwardPath", "ForwardPaths", "NativeDecodePath", "NativeHeadPath",
    "PipelinePath", "PreparedStep", "micro_batches",
]


class ForwardPaths:
    """The paths one runner can take. Which exist is fixed when they are built: with pipeline
    stages, the pipeline path alone; with CUDA graphs, graph replay (falling back to the native
    decode path or eager); else the native paths where the fused decode step exists, and eager."""

    def __init__(self, eager: EagerPath, *, pipeline: PipelinePath | None = None,
                 cuda_graph: CudaGraphPath | None = None, native: NativeDecodePath | None = None,
                 native_head: NativeHeadPath | None = None) -> None:
        self.eager = eager
        self.pipeline = pipeline
        self.cuda_graph = cuda_graph
        self.native = native
        self.native_head = native_head
        if native is not None:  # prompt steps follow the fused decode step's stall guard (EagerPath.run)
            eager.guard = native.nd.guard

    def select_path(self, step: PreparedStep) -> ForwardPath:
        """The path this step takes."""
        if self.pipeline is not None:
            return self.pipeline
        if self.cuda_graph is None and self.native is None:
            return self.eager
        graph = self.cuda_graph
        if graph is not None:  # adapter rows replay where the graphs hold the Triton LoRA kernels
            return graph if graph.lora or not step.lora else self.eager
        if step.lora and (self.native is None or not self.native.nd.lora):
            return self.eager  # adapter rows run through the torch layers (or the fused step, below)
        native = self.native
        if native is not None and native.applies(step):
            head = self.native_head
            return head if head is not None and head.applies(step) else native
        return self.eager
