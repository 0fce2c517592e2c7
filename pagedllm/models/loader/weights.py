"""Weights of a model source as ``(Hugging Face name, tensor)`` pairs, whatever the format."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagedllm.models.loader.gguf_reader import read_gguf_header
from pagedllm.models.loader.gguf_weights import iterate_gguf
from pagedllm.models.loader.quantized import iterate_awq_gptq, iterate_compressed
from pagedllm.models.loader.hf import check_safetensors, iterate_safetensors, safetensors_files
from pagedllm.models.loader.source import ModelSource


def iterate_weights(source: ModelSource, quantization: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` for every parameter of ``source``.

    With a :class:`pagedllm.quantization.QuantizationSetup` for a pre-quantized checkpoint
    (gguf, awq, gptq, compressed-tensors, fp8), quantized modules come as
    ``<module>.codes/.scales/.zeros`` (:mod:`pagedllm.quantization.formats`, ``.compressed``).
    All files are validated before the first tensor.
    """
    method = getattr(quantization, "method", None)
    if source.kind == "gguf":
        kept = quantization.gguf_kept if method == "gguf" else frozenset()
        return iterate_gguf(read_gguf_header(source.path), kept)
    files = safetensors_files(Path(source.path))
    for path in files:
        check_safetensors(path)
    if method in ("awq", "gptq"):
        offset = quantization.gptq_zero_offset() if method == "gptq" else 0
        return iterate_awq_gptq(files, method, quantization.group_size, offset)
    if getattr(quantization, "compressed", None) is not None:
        return iterate_compressed(files, quantization)
    return iterate_safetensors(files)
