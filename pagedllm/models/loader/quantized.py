"""Pre-quantized safetensors folders: each quantized module's tensors are gathered across shards
and decoded into the codes its LinearMethod keeps.

AWQ and GPTQ: ``qweight``/``qzeros``/``scales`` (/``g_idx``) -> 4-bit group codes.
compressed-tensors and FP8 (:mod:`pagedllm.quantization.compressed`): group codes, e4m3 bytes
or int8 W8A8 codes; a quantized module the model keeps in float gets its expanded weight."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagedllm.models.loader.hf import iterate_safetensors
from pagedllm.models.loader.source import ModelLoadError

logger = logging.getLogger(__name__)

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


def iterate_compressed(files: list[Path], setup: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a compressed-tensors or FP8 folder: float tensors as float32; per
    quantized module ``<module>.codes/.scales/.zeros`` (``.perm``) where the model keeps its group
    codes, ``<module>.codes/.scales`` (int8, per row) where it runs them as w8a8, else its expanded
    ``<module>.weight``. ``setup`` is the :class:`pagedllm.quantization.QuantizationSetup`."""
    from pagedllm.quantization.compressed import DROPPED, PARTS, group_codes, w8a8_codes
    from pagedllm.quantization.formats import QuantFormatError

    config = setup.compressed
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dropped: set[str] = set()
    for name, tensor in iterate_safetensors(files, raw=True):
        module, _, part = name.rpartition(".")
        if part in DROPPED:
            dropped.add(part)
        elif part in PARTS or (part == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn)):
            pending.setdefault(module, {})[part] = tensor
        else:
            yield name, tensor.to(torch.float32)
    where = f"{setup.method} checkpoint {files[0].parent}"
    for module, parts in pending.items():
        scheme = config.scheme(module)
        if scheme is None and not {"weight", "weight_packed"} & parts.keys():
            dropped.update(f"{p} of float modules" for p in parts)  # scales beside a float weight
            continue
        if scheme is None:
            raise ModelLoadError(f"{where}: module {module!r} stores quantized tensors "
                                 f"({', '.join(sorted(parts))}) but no quantization config group targets it")
        kept = setup.kept.get(module)
        try:
            if kept == "w8a8":
                codes, scales = w8a8_codes(module, parts)
                yield f"{module}.codes", codes
                yield f"{module}.scales", scales
                continue
            gc = group_codes(module, scheme, parts)
        except QuantFormatError as exc:
            raise ModelLoadError(f"{where}: {exc}") from None
        if kept is None:
            yield f"{module}.weight", gc.dequantize(scheme.code_bits)
            continue
        yield f"{module}.codes", gc.codes
        yield f"{module}.scales", gc.scales
        yield f"{module}.zeros", gc.zeros
        if scheme.act_order:
            yield f"{module}.perm", gc.perm if gc.perm is not None else torch.arange(gc.codes.shape[1])
    if dropped:
        logger.info("%s: dropped the checkpoint's %s (activations run in the model dtype, or int8 per token "
                    "in W8A8 layers; the KV cache follows --kv-cache-dtype)", files[0].parent,
                    ", ".join(sorted(dropped)))


def _gguf_module_tensors(path: Path) -> dict[str, Any]:
    """Checkpoint module name -> the GGUF file's tensor info of its weight."""
    from pagedllm.models.loader.gguf_reader import read_gguf_header
    from pagedllm.models.loader.gguf_weights import gguf_to_hf_name

    out: dict[str, Any] = {}
    header = read_gguf_header(path)
    for t in header.tensors.values():
        hf = gguf_to_hf_name(t.name, header.arch)
        if hf and hf.endswith(".weight"):
            out[hf.removesuffix(".weight")] = t
    return out


def checkpoint_quantization(source: Any, hf_config: Any) -> str | None:
    """'awq' / 'gptq' / ... from config.json's quantization_config, 'gguf' for a GGUF whose linear
    weights are in block types pagedllm keeps quantized, else None."""
    from pagedllm.quantization import GGUF_TYPES, hf_quant_config

    if source.kind == "gguf":
        linear = [t for m, t in _gguf_module_tensors(source.path).items() if m.endswith("_proj")]
        return "gguf" if any(t.qtype in GGUF_TYPES for t in linear) else None
    qc = hf_quant_config(hf_config)
    method = str(qc.get("quant_method", "")).lower() if qc else ""
    return method or None


def quantization_setup(model_config: Any) -> Any:
    """The :class:`pagedllm.quantization.QuantizationSetup` of a model with a quantization, reading
    a GGUF file's tensor types (which blocks stay quantized, whether the LM head runs from codes)."""
    from pagedllm.quantization import QuantizationSetup

    gguf = model_config.quantization.method == "gguf" or getattr(model_config, "kind", None) == "gguf"
    return QuantizationSetup(model_config, _gguf_module_tensors(model_config.path) if gguf else None)
