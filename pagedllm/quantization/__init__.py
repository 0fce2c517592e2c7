"""Quantized linear layers: which scheme each layer gets, and the load-time summary.

:class:`QuantizationSetup` is built once from the model config; the model asks it for each
linear layer's method (``linear_method(prefix, shards)``), the loader asks it which GGUF
tensors to keep in blocks, and :func:`process_model` finishes every layer after loading and
logs what was quantized and the weight memory before and after.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import Any

import torch
from torch import nn

from pagedllm.config import ModelConfig, QuantizationConfig
from pagedllm.quantization.formats import GGUF_TYPES
from pagedllm.quantization.methods import (
    Fp8LinearMethod,
    GroupCodesLinearMethod,
    Int4LinearMethod,
    Int8LinearMethod,
    W8A8LinearMethod,
    runtime_bytes,
)

logger = logging.getLogger(__name__)


def checkpoint_quantization(source: Any, hf_config: Any) -> str | None:
    """'awq' / 'gptq' from config.json's quantization_config, 'gguf' for a GGUF whose linear
    weights are in block types pagedllm keeps quantized, else None."""
    if source.kind == "gguf":
        from pagedllm.models.loader import gguf_to_hf_name, read_gguf_header

        header = read_gguf_header(source.path)
        linear = [t for t in header.tensors.values()
                  if (gguf_to_hf_name(t.name) or "").endswith("_proj.weight")]
        return "gguf" if any(t.qtype in GGUF_TYPES for t in linear) else None
    qc = _hf_quant_config(hf_config)
    method = str(qc.get("quant_method", "")).lower() if qc else ""
    return method or None


def _hf_quant_config(hf_config: Any) -> dict[str, Any]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return {}
    return dict(qc) if isinstance(qc, dict) else dict(qc.to_dict())


class QuantizationSetup:
    """Per-layer quantization choices for one model."""

    def __init__(self, model_config: ModelConfig) -> None:
        assert model_config.quantization is not None
        self.config: QuantizationConfig = model_config.quantization
        self.method = self.config.method
        self.gguf_kept: set[str] = set()
        """Checkpoint module names whose GGUF blocks are kept (not expanded to float)."""
        self._gguf_types: dict[str, int] = {}
        if self.method == "gguf" or getattr(model_config, "kind", None) == "gguf":
            from pagedllm.models.loader import gguf_to_hf_name, read_gguf_header

            for t in read_gguf_header(model_config.path).tensors.values():
                hf = gguf_to_hf_name(t.name)
                if hf and hf.endswith(".weight"):
                    self._gguf_types[hf.removesuffix(".weight")] = t.qtype
        self.hf = _hf_quant_config(model_config.hf_config)

    @property
    def lm_head_int8(self) -> bool:
        """Whether the LM head runs from int8 codes: where the model is a GGUF file that keeps the
        output tensor (or the tied embedding) in a quantized type, as llama.cpp then does, whatever
        the scheme of the linear layers (``PAGEDLLM_QUANT_LM_HEAD=0`` keeps it dense)."""
        if os.environ.get("PAGEDLLM_QUANT_LM_HEAD", "1") == "0":
            return False
        head = self._gguf_types.get("lm_head", self._gguf_types.get("model.embed_tokens"))
        return head in GGUF_TYPES

    def skipped(self, prefix: str, shards: list[str]) -> bool:
        names = [prefix, *shards]
        return any(fnmatch.fnmatchcase(n, g) for g in self.config.skip_globs for n in names)

    def linear_method(self, prefix: str, shards: list[str]) -> Any:
        """The method for the linear layer ``prefix`` (fused from checkpoint modules ``shards``);
        None keeps it in the model dtype."""
        if self.method in ("awq", "gptq"):
            return self._awq_gptq()
        if self.skipped(prefix, shards):
            return None
        if self.method == "gguf":
            return self._gguf(shards)
        if self.method == "int4":
            return Int4LinearMethod(self.config.group_size, self.config.clip_search)
        return {"int8": Int8LinearMethod, "w8a8": W8A8LinearMethod, "fp8": Fp8LinearMethod}[self.method]()

    def _gguf(self, shards: list[str]) -> Any:
        types = [self._gguf_types.get(s) for s in shards]
        if any(t not in GGUF_TYPES for t in types):
            return None
        bits = max(GGUF_TYPES[t][1] for t in types)  # type: ignore[index]
        group = min(GGUF_TYPES[t][2] for t in types)  # type: ignore[index]
        self.gguf_kept.update(shards)
        return GroupCodesLinearMethod("gguf", bits, group)

    def _awq_gptq(self) -> Any:
        bits = int(self.hf.get("bits", self.hf.get("w_bit", 4)))
        group = int(self.hf.get("group_size", self.hf.get("q_group_size", 128)))
        if bits != 4:
            raise ValueError(f"{self.method} checkpoint with bits={bits}: only 4-bit is supported")
        act_order = self.method == "gptq" and bool(self.hf.get("desc_act", False))
        return _LazyGroup(self.method, bits, group, act_order)

    def gptq_zero_offset(self) -> int:
        """1 for GPTQ's original format (zeros stored minus one), 0 for ``gptq_v2``."""
        fmt = str(self.hf.get("checkpoint_format", "gptq")).lower()
        return 0 if fmt == "gptq_v2" else 1

    @property
    def group_size(self) -> int:
        return int(self.hf.get("group_size", self.hf.get("q_group_size", 128)))


class _LazyGroup(GroupCodesLinearMethod):
    """AWQ/GPTQ: group size -1 (one group per row) resolves to the layer's input size."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        if self.group_size in (-1, 0):
            self.group_size = in_features
        super().create_weights(layer, in_features, out_features, dtype)


def process_model(model: nn.Module, dtype: torch.dtype, label: str,
                  setup: QuantizationSetup | None = None) -> dict[str, int]:
    """Finish every linear layer's weights (and the LM head's int8 codes where ``setup`` asks for
    them) after loading; log what was quantized and the weight memory (all parameters and
    buffers) before and after. Returns the byte counts."""
    from pagedllm.quantization import native

    head = getattr(model, "lm_head", None)
    if setup is not None and setup.lm_head_int8 and head is not None and hasattr(head, "keep_int8") \
            and native.fits(head.weight.shape[1], 32):
        head.keep_int8()
        logger.info("LM head: int8 codes per 32 inputs for decode rows (the GGUF keeps it quantized)")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    before = after = 0
    counts: dict[str, int] = {}
    for _name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None:
            continue
        dense = module.in_features * module.out_features * itemsize
        qm.process_weights_after_loading(module)
        kind = getattr(qm, "name", "unquantized")
        counts[kind] = counts.get(kind, 0) + 1
        before += dense
        after += runtime_bytes(module) if kind != "unquantized" else dense
    linear_ids = {id(t) for m in model.modules() if getattr(m, "quant_method", None) is not None
                  for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    others = {id(t): t for t in model.parameters() if id(t) not in linear_ids}
    rest = sum(t.numel() * t.element_size() for t in others.values() if t.dtype.is_floating_point)
    total_before, total_after = before + rest, after + rest
    if label:
        logger.info(
            "%s: linear layers %s; weight memory %.1f MiB -> %.1f MiB (linear %.1f -> %.1f MiB; "
            "embeddings, norms and lm_head kept in %s)",
            label, ", ".join(f"{n}: {c}" for n, c in sorted(counts.items())),
            total_before / 2**20, total_after / 2**20, before / 2**20, after / 2**20, str(dtype).removeprefix("torch."),
        )
    return {"before": total_before, "after": total_after, "linear_before": before, "linear_after": after}
