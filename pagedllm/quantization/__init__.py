"""Quantized linear layers: which scheme each layer gets, and the load-time summary.

:class:`QuantizationSetup` is built once from the model config; the model asks it for each
linear layer's method (``linear_method(prefix, shards)``), the loader asks it which GGUF
tensors to keep in blocks, and :func:`process_model` finishes every layer after loading and
logs what was quantized and the weight memory before and after.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

import torch
from torch import nn

from pagedllm import envs
from pagedllm.config import ModelConfig, QuantizationConfig
from pagedllm.quantization.compressed import CompressedConfig, WeightScheme
from pagedllm.quantization.formats import GGUF_TYPES
from pagedllm.quantization.vocab import RowCodes, quantize_rows, rows_from_group_codes
from pagedllm.quantization.methods import (
    Fp8LinearMethod,
    GroupCodesLinearMethod,
    Int4LinearMethod,
    Int8LinearMethod,
    StoredW8A8LinearMethod,
    W8A8LinearMethod,
    runtime_bytes,
)

logger = logging.getLogger(__name__)


def hf_quant_config(hf_config: Any) -> dict[str, Any]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return {}
    return dict(qc) if isinstance(qc, dict) else dict(qc.to_dict())


class QuantizationSetup:
    """Per-layer quantization choices for one model."""

    def __init__(self, model_config: ModelConfig, gguf_tensors: dict[str, Any] | None = None) -> None:
        """`gguf_tensors`: for a GGUF model, checkpoint module name -> the file's tensor info of its
        weight (``pagedllm.models.loader.quantization_setup`` reads them)."""
        assert model_config.quantization is not None
        self.config: QuantizationConfig = model_config.quantization
        self.method = self.config.method
        self.gguf_kept: set[str] = set()
        """Checkpoint module names whose GGUF blocks are kept (not expanded to float)."""
        self._gguf_tensors: dict[str, Any] = dict(gguf_tensors or {})
        self._gguf_types: dict[str, int] = {m: t.qtype for m, t in self._gguf_tensors.items()}
        self.path = model_config.path
        self.hf = hf_quant_config(model_config.hf_config)
        self.compressed: CompressedConfig | None = None
        """The schemes of a compressed-tensors or FP8 checkpoint (None for other methods)."""
        self.kept: dict[str, str] = {}
        """Checkpoint module -> how its stored codes are kept (``codes`` or ``w8a8``); the loader
        expands the codes of every other quantized module to a float weight."""
        stored = str(self.hf.get("quant_method", "")).lower()
        if self.method == "compressed-tensors" or (self.method == "fp8" and stored == "fp8"):
            self.compressed = CompressedConfig(self.hf)
            logger.info("%s checkpoint: %s", stored, self.compressed.describe())

    @property
    def lm_head_int8(self) -> bool:
        """Whether the LM head runs from int8 codes: where the model is a GGUF file that keeps the
        output tensor (or the tied embedding) in a quantized type, as llama.cpp then does, whatever
        the scheme of the linear layers (``PAGEDLLM_QUANT_LM_HEAD=0`` keeps it dense)."""
        if not envs.PAGEDLLM_QUANT_LM_HEAD or self.config.embeddings:
            return False
        head = self._gguf_types.get("lm_head", self._gguf_types.get("model.embed_tokens"))
        return head in GGUF_TYPES

    def vocab_codes(self, module: str, weight: torch.Tensor) -> tuple[RowCodes, str]:
        """The codes (and how they were made, for the log) that replace the loaded ``weight`` of
        the vocabulary module ``module`` (``model.embed_tokens`` or ``lm_head``, as the checkpoint
        names it) under ``--quantize-embeddings``: a GGUF's own blocks where they fit the kernel,
        else the scheme's quantizer."""
        info = self._gguf_tensors.get(module) if self.method == "gguf" else None
        if info is not None and info.qtype in GGUF_TYPES and GGUF_TYPES[info.qtype][2] % 32 == 0 \
                and weight.shape[1] % GGUF_TYPES[info.qtype][2] == 0:
            import numpy as np

            from pagedllm.quantization.formats import gguf_group_codes

            raw = np.memmap(self.path, dtype=np.uint8, mode="r")[info.offset : info.offset + info.n_bytes]
            gc = gguf_group_codes(raw, info.qtype, info.torch_shape)
            name, bits, _ = GGUF_TYPES[info.qtype]
            return rows_from_group_codes(gc.codes, gc.scales, gc.zeros, bits), f"the file's {name} blocks"
        method = "int8" if self.method == "gguf" else self.method
        rc = quantize_rows(weight, method, self.config.group_size, self.config.clip_search)
        what = {8: "int8 per 32 inputs", 4: f"int4 groups of {rc.group}", 3: "fp8 e4m3 per row"}[rc.bits]
        return rc, what

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
        if self.compressed is not None:
            return self._compressed(shards)
        if self.method == "gguf":
            return self._gguf(shards)
        if self.method == "int4":
            return Int4LinearMethod(self.config.group_size, self.config.clip_search)
        return {"int8": Int8LinearMethod, "w8a8": W8A8LinearMethod, "fp8": Fp8LinearMethod}[self.method]()

    def expert_method(self, prefix: str, shards: list[str]) -> Any:
        """The method of one mixture-of-experts expert's linear layer (``layers/moe.py``): as
        ``linear_method`` for the schemes that quantize a float checkpoint at load (int8, w8a8,
        int4, fp8); experts stored quantized (AWQ, GPTQ, GGUF, compressed-tensors, FP8
        checkpoints) raise ValueError."""
        if self.method in ("awq", "gptq", "gguf") or self.compressed is not None:
            raise ValueError(f"quantization {self.method!r}: mixture-of-experts experts stored quantized are not "
                             "supported; quantize a float checkpoint's experts at load with int8, w8a8, int4 or fp8")
        return self.linear_method(prefix, shards)

    def _gguf(self, shards: list[str]) -> Any:
        types = [self._gguf_types.get(s) for s in shards]
        if any(t not in GGUF_TYPES for t in types):
            return None
        bits = max(GGUF_TYPES[t][1] for t in types)  # type: ignore[index]
        group = min(GGUF_TYPES[t][2] for t in types)  # type: ignore[index]
        self.gguf_kept.update(shards)
        return GroupCodesLinearMethod("gguf", bits, group)

    def _compressed(self, shards: list[str]) -> Any:
        """The stored codes' method where every shard of the layer has one kind of codes (their group
        sizes may differ: the finest serves all); None (expanded to float) otherwise."""
        assert self.compressed is not None
        schemes = [self.compressed.scheme(s) for s in shards]
        first = schemes[0]
        if first is None or any(s is None or (s.kind, s.bits, s.w8a8, s.act_order) !=
                                (first.kind, first.bits, first.w8a8, first.act_order) for s in schemes):
            return None
        self.kept.update({s: "w8a8" if first.w8a8 else "codes" for s in shards})
        if first.w8a8:
            return StoredW8A8LinearMethod()
        return _StoredGroups(self.method, first.code_bits, schemes)  # type: ignore[arg-type]

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


class _StoredGroups(GroupCodesLinearMethod):
    """compressed-tensors / FP8 codes: the group size follows from each shard's scheme and the
    layer's input size (one group per row for tensor and channel scales)."""

    def __init__(self, name: str, bits: int, schemes: list[WeightScheme]) -> None:
        super().__init__(name, bits, 0, act_order=schemes[0].act_order)
        self.schemes = schemes

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        self.group_size = min(s.group(in_features) for s in self.schemes)
        super().create_weights(layer, in_features, out_features, dtype)


def quantize_vocab(model: nn.Module, setup: QuantizationSetup) -> tuple[int, int]:
    """Replace the token embedding's and the LM head's dense weights by codes (one set for a tied
    pair, as the model's own tying shares one weight); returns their bytes before and after."""
    from pagedllm.quantization import native

    before = after = 0
    done: dict[int, RowCodes] = {}
    for attr, ckpt in (("embed_tokens", "model.embed_tokens"), ("lm_head", "lm_head")):
        mod = getattr(model, attr, None)
        if mod is None or not hasattr(mod, "use_codes"):
            continue
        w = mod.weight
        if id(w) in done:
            mod.use_codes(done[id(w)])
            logger.info("%s: shares the embedding's codes (tied)", attr)
            continue
        if not native.fits(w.shape[1], 32):
            raise ValueError(f"--quantize-embeddings: the native quantized kernel does not run here (CPUs with AVX-512 "
                             f"BF16 or AVX2 + FMA) or does not take hidden size {w.shape[1]}")
        tied_ckpt = "model.embed_tokens" if getattr(model.config, "tie_word_embeddings", False) else ckpt
        rc, what = setup.vocab_codes(tied_ckpt, w.data)
        before += w.numel() * w.element_size()
        after += sum(t.numel() * t.element_size() for t in rc.tensors())
        done[id(w)] = rc
        mod.use_codes(rc)
        logger.info("%s: %s (%d rows)", attr, what, w.shape[0])
    return before, after


def process_model(model: nn.Module, dtype: torch.dtype, label: str,
                  setup: QuantizationSetup | None = None) -> dict[str, int]:
    """Finish every linear layer's weights (and the LM head's int8 codes where ``setup`` asks for
    them, or the embedding's and LM head's codes under ``--quantize-embeddings``) after loading;
    log what was quantized and the weight memory (all parameters and buffers) before and after.
    Returns the byte counts."""
    from pagedllm.quantization import native

    head = getattr(model, "lm_head", None)
    vocab_before = vocab_after = 0
    if setup is not None and setup.config.embeddings:
        vocab_before, vocab_after = quantize_vocab(model, setup)
    elif setup is not None and (setup.lm_head_int8 or setup.config.lm_head) and head is not None \
            and hasattr(head, "keep_codes") and native.fits(head.weight.shape[1], 32):
        c = setup.config
        head.keep_codes(c.method if c.lm_head else "int8", c.group_size, c.clip_search)
        vocab_after = sum(t.numel() * t.element_size() for t in head.quant_codes[2:])  # beside the dense weight
        bits, group = head.qlayout
        logger.info("LM head: %s codes per %d inputs for decode rows (%s), %.1f MiB beside its dense weight",
                    {8: "int8", 4: "int4", 3: "fp8"}[bits], group,
                    f"lm_head {c.method}" if c.lm_head else "the GGUF keeps it quantized", vocab_after / 2**20)
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
    total_before, total_after = before + rest + vocab_before, after + rest + vocab_after
    if label:
        dt = str(dtype).removeprefix("torch.")
        if vocab_before:
            kept = (f"embeddings and lm_head as codes ({vocab_before / 2**20:.1f} -> {vocab_after / 2**20:.1f} MiB), "
                    f"norms kept in {dt}")
        else:
            kept = f"embeddings, norms and lm_head kept in {dt}" + (
                f", and {vocab_after / 2**20:.1f} MiB of the LM head's int8 codes" if vocab_after else "")
        logger.info(
            "%s: linear layers %s; weight memory %.1f MiB -> %.1f MiB (linear %.1f -> %.1f MiB; %s)",
            label, ", ".join(f"{n}: {c}" for n, c in sorted(counts.items())),
            total_before / 2**20, total_after / 2**20, before / 2**20, after / 2**20, kept,
        )
    return {"before": total_before, "after": total_after, "linear_before": before, "linear_after": after,
            "vocab_before": vocab_before, "vocab_after": vocab_after}
