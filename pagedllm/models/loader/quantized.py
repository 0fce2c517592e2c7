"""AWQ and GPTQ safetensors folders: per linear module, ``qweight``/``qzeros``/``scales``
(/``g_idx``) are gathered across shards and decoded into group codes, which stay 4-bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.models.loader.hf import iterate_safetensors
from pagedllm.models.loader.source import ModelLoadError

_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def iterate_awq_gptq(files: list[Path], method: str, group_size: int, zero_offset: int
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)``: float tensors as stored, and ``<module>.codes/.scales/.zeros`` (and
    ``.perm`` for GPTQ act-order) for each quantized module."""
    from pagedllm.quantization.formats import QuantFormatError, awq_group_codes, gptq_group_codes

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iterate_safetensors(files, raw=True):
        module, _, part = name.rpartition(".")
        if part in _PARTS:
            pending.setdefault(module, {})[part] = tensor
        else:
            yield name, tensor.to(torch.float32)
    for module, parts in pending.items():
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise ModelLoadError(f"{method} checkpoint {files[0].parent}: module {module!r} lacks "
                                 + ", ".join(f"{module}.{p}" for p in missing))
        try:
            if method == "awq":
                gc = awq_group_codes(module, parts["qweight"], parts["qzeros"], parts["scales"], group_size)
            else:
                gc = gptq_group_codes(module, parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                      group_size, zero_offset=zero_offset)
        except QuantFormatError as exc:
            raise ModelLoadError(f"{method} checkpoint {files[0].parent}: {exc}") from None
        yield f"{module}.codes", gc.codes
        yield f"{module}.scales", gc.scales
        yield f"{module}.zeros", gc.zeros
        if gc.perm is not None:
            yield f"{module}.perm", gc.perm
