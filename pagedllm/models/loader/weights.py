"""Weights of a model source as ``(Hugging Face name, tensor)`` pairs, whatever the format."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.models.loader.gguf_reader import read_gguf_header
from pagedllm.models.loader.gguf_weights import iterate_gguf
from pagedllm.models.loader.hf import check_safetensors, iterate_safetensors, safetensors_files
from pagedllm.models.loader.source import ModelSource


def iterate_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` for every parameter of ``source``.

    All files are validated before the first tensor is yielded.
    """
    if source.kind == "gguf":
        return iterate_gguf(read_gguf_header(source.path))
    files = safetensors_files(Path(source.path))
    for path in files:
        check_safetensors(path)
    return iterate_safetensors(files)
