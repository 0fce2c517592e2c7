"""GGUF tensors as Hugging Face-named weights: renaming, llama.cpp's Q/K permutation, dequantization.

``gguf`` supplies the type tables and the dequantization of the less common block types;
Q4_0/Q4_1/Q8_0/F16/BF16/F32 use vectorized numpy kernels here (about 20x faster than the
generic ones in ``gguf.quants``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from pagedllm.models.loader.gguf_reader import GGUFHeader
from pagedllm.models.loader.source import ModelLoadError

logger = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
# Phi-3's LongRoPE factors are tensors in llama.cpp's file; the config takes them (loader/config.py).
_GGUF_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Gemma 3's layer names where they differ from the table above: QK-norm and the sandwich norms
# (llama.cpp's `ffn_norm` is Gemma's pre-feedforward norm, its post-attention norm has its own name).
_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3: the Llama names and the per-head q/k norms (llama.cpp permutes nothing for qwen* files).
_QWEN3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Phi-3: the checkpoint's fused projections kept fused (`ffn_up` holds gate and up, gate first).
_PHI3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES, "qwen3": _QWEN3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
# Architectures whose norm weights llama.cpp's converter stored as 1 + w (Gemma's RMSNorm scales
# by 1 + w; the Hugging Face checkpoint, and pagedllm's GemmaRMSNorm, hold w).
_NORM_PLUS_ONE = frozenset({"gemma3"})


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = _LAYER_NAMES_BY_ARCH.get(arch, _GGUF_LAYER_NAMES)
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def iterate_gguf(header: GGUFHeader, kept: frozenset[str] | set[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each GGUF tensor under its HF name, with llama.cpp's Q/K permutation undone.

    Tensors of modules in ``kept`` (e.g. ``model.layers.0.mlp.down_proj``) stay in their blocks:
    they are yielded as ``<module>.codes`` / ``.scales`` / ``.zeros`` (see
    :mod:`pagedllm.quantization.formats`); all others are dequantized to float32.
    """
    heads = _permute_heads(header)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    start = time.perf_counter()
    for info in header.tensors.values():
        hf_name = gguf_to_hf_name(info.name, header.arch)
        if hf_name is None:
            if info.name not in _GGUF_IGNORED:
                logger.warning("GGUF file %s: skipping unknown tensor %r", header.path, info.name)
            continue
        n_head = next((h for key, h in heads.items() if key in info.name), None)
        try:
            raw = data[info.offset : info.offset + info.n_bytes]
            module = hf_name.removesuffix(".weight")
            if module in kept:
                parts = _group_codes(raw, info.qtype, info.torch_shape)
            else:
                parts = {"weight": dequantize_gguf(raw, info.qtype, info.torch_shape)}
            if n_head is not None:
                parts = {k: unpermute_qk(v, n_head) for k, v in parts.items()}
            if header.arch in _NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
                parts = {"weight": parts["weight"] - 1.0}
        except ModelLoadError:
            raise
        except Exception as exc:  # numpy/torch shape or dtype errors
            raise ModelLoadError(
                f"GGUF file {header.path}: cannot decode tensor {info.name!r}: {exc}"
            ) from exc
        if module in kept:
            for key, value in parts.items():
                yield f"{module}.{key}", value
        else:
            yield hf_name, parts["weight"]
    logger.info("read the weights of %s in %.2f s", header.path, time.perf_counter() - start)


def _group_codes(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    from pagedllm.quantization.formats import gguf_group_codes

    gc = gguf_group_codes(raw, qtype, shape)
    return {"codes": gc.codes, "scales": gc.scales, "zeros": gc.zeros}


def _permute_heads(header: GGUFHeader) -> dict[str, int]:
    """Which tensors llama.cpp permuted (llama arch only) and with how many heads."""
    if header.arch != "llama":
        return {}
    heads = int(header.require("llama.attention.head_count"))
    kv_heads = int(header.metadata.get("llama.attention.head_count_kv", heads))
    return {".attn_q.": heads, ".attn_k.": kv_heads}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's rotary row interleave of a Q or K projection.

    The converter stored ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``
    with ``d = rows // n_head``; e.g. one head of 4 rows [r0, r1, r2, r3] was
    written as [r0, r2, r1, r3]. Swapping the axes back restores HF order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_gguf(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of ``shape`` from the raw uint8 bytes of one GGUF tensor.

    ``raw`` may be a read-only memmap slice; the result never aliases it.
    """
    fast = _NUMPY_DEQUANT.get(qtype)
    if fast is not None:
        out = fast(raw)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = raw.reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        out = np.array(dequantize(rows, GGMLQuantizationType(qtype)), dtype=np.float32)
    return torch.from_numpy(out).reshape(shape)


def _fp16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of each block, as a float32 ``[n, 1]`` column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0: blocks of [fp16 d][32 x int8 q]; x = d * q."""
    blocks = raw.reshape(-1, 34)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _fp16_column(blocks, 0)
    return out


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] float32: low nibbles are elements 0..15, high 16..31."""
    out = np.empty((qs.shape[0], 32), dtype=np.float32)
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def _dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0: blocks of [fp16 d][16 bytes of 4-bit q]; x = d * (q - 8)."""
    blocks = raw.reshape(-1, 18)
    out = _nibbles(blocks[:, 2:])
    out -= 8.0
    out *= _fp16_column(blocks, 0)
    return out


def _dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1: blocks of [fp16 d][fp16 m][16 bytes of 4-bit q]; x = d * q + m."""
    blocks = raw.reshape(-1, 20)
    out = _nibbles(blocks[:, 4:])
    out *= _fp16_column(blocks, 0)
    out += _fp16_column(blocks, 2)
    return out


def _dequant_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the upper half of a float32."""
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _dequant_f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _dequant_f32(raw: np.ndarray) -> np.ndarray:
    return np.array(raw.view(np.float32))


# numpy kernels (these run ~20x faster than gguf.quants' generic block code).
# gguf.GGMLQuantizationType values: F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=8, BF16=30.
_NUMPY_DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    0: _dequant_f32, 1: _dequant_f16, 2: _dequant_q4_0, 3: _dequant_q4_1,
    8: _dequant_q8_0, 30: _dequant_bf16,
}

