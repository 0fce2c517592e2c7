"""Process groups, tensor-parallel collectives, pipeline hand-off: the only code that touches
torch.distributed."""

from pagedllm.distributed.parallel_state import ParallelContext, TensorParallelGroup, init_parallel_context

__all__ = ["ParallelContext", "TensorParallelGroup", "init_parallel_context"]
