"""Builds a model for a runner: its class from the registry, quantized layers where configured,
weights from the checkpoint (or dummy values), processed for their kernels, moved to huge pages on
the CPU. The target model and a speculative draft model are built the same way."""

from __future__ import annotations

import mmap

import torch

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.models.loader import ModelSource, iterate_weights
from pagedllm.models.loader.quantized import quantization_setup
from pagedllm.models.registry import get_model_class
from pagedllm.quantization import process_model
from pagedllm.utils import trim_heap
from pagedllm.worker import device as dev
from pagedllm.worker.host_memory import move_weights_to_huge_pages


def build_model(mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                parallel: ParallelContext) -> tuple[torch.nn.Module, mmap.mmap | None]:
    """(the loaded model in eval mode, the arena holding its weights on the CPU or None)."""
    cls = get_model_class(mc.hf_config)
    quant = quantization_setup(mc) if mc.quantization is not None else None
    with torch.device(device):
        model = cls(mc.hf_config, dtype=dtype, parallel=parallel, quant_config=quant)
    if mc.load_format == "dummy":
        dev.initialize_dummy_weights(model, mc.seed)
    else:
        source = ModelSource(kind=mc.kind, path=mc.path, name=mc.served_model_name)  # type: ignore[arg-type]
        model.load_weights(iterate_weights(source, quant))
    process_model(model, dtype, f"{mc.quantization.method} quantization" if quant else "", quant)
    arena = None
    if device.type != "cuda":
        arena = move_weights_to_huge_pages(model)
        trim_heap()  # the loaded copies' pages, freed into a heap that keeps its free pages
    model.eval()
    return model, arena
