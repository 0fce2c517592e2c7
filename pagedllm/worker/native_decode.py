"""Decode steps of a few rows as one native call (pagedllm/native/csrc/llama_decode.c): the CPU's
decode graph.

A decode step of a small batch reads every weight once for a handful of rows; run as torch ops,
its time is mostly per-op dispatch (about 80 ops per layer), not the weight reads. This runs the
whole decoder stack for such a step in one C call over the model's own parameters and KV cache,
in float32 or bfloat16 (and float16 for dense models where the small-M kernel has its float16
form), with the same paged attention kernel as every other step. Where the
step's sampled rows are few enough that the torch path's LM head is the same small-M GEMM (see
small_m_rows), the call goes on through the LM head: it returns those rows' logits, or, when every row
samples greedily with nothing else to apply, their argmax, so that such a step runs no torch op.

It applies to Llama-family models (Llama, Mistral, Qwen2, SmolLM2), Qwen3 (its per-head
RMSNorm of queries and keys before RoPE runs in the step too) with Qwen3-MoE's and Mixtral's
mixture-of-experts blocks where their experts are dense (worker/native_moe.py) and Gemma 3 in float32 or bfloat16
(Gemma's norms and GELU-tanh, the embedding scale, the norms of the sublayers' outputs, and each
layer's window, RoPE table and KV layer group, whose slots and block tables the step takes from
the batch) on one CPU rank, with a KV cache in the model dtype, whose linear layers are each
either dense in the model dtype or quantized in a layout of the native quantized kernel (4-bit group codes of int4 / GGUF / AWQ / GPTQ, int8, fp8, w8a8's
row-major int8 codes with per-token int8 activations; the C step calls the same kernel function as
the LinearMethod); every other step, and every other
configuration, runs the torch path. `PAGEDLLM_NATIVE_DECODE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import time
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from pagedllm import native
from pagedllm.core.kv_groups import KVCacheGroups, single_group
from pagedllm.layers.linear import UnquantizedLinearMethod
from pagedllm.layers.native_linear import AVX512_FORM, small_m_rows
from pagedllm.native import kernels
from pagedllm.native.declare import Binding
from pagedllm.native.kernels import LlamaDecodeModel as _Model
from pagedllm.native.kernels import LoraLinear as _LoraLinear
from pagedllm.native.kernels import QuantLinear as _QuantLinear
from pagedllm.quantization.native import int8_activations, kernel_rows
from pagedllm.worker.native_moe import bind_moe, is_moe, moe_reason
from pagedllm.worker.stall_guard import StallGuard

logger = logging.getLogger(__name__)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16)  # argmax_rows' element types
# Most rows one call takes (the C side's limit).
MAX_ROWS = 256
# Most rows of a step the fused call takes, per dtype: up to where it stops beating the torch path
# (benchmarks/bench_native_decode.py, 2-core AVX-512 machine, 256 tokens of context per row, the
# table in docs/benchmarks.md): bf16 1.4-1.6x at 16 rows, 1.0-1.3x at 32-64, 1.1-1.5x at 80-128,
# 1.1-1.2x at 160-256 (0.95x at 192 in one run of three); float32 1.4x at 16, 1.02-1.08x at 32,
# 0.97-1.01x at 48, 0.84x at 64. From about 96 rows the kernel's GEMMs are slower than oneDNN's
# (0.85-0.92x its speed at 128 rows), which the one call's saved per-op dispatch and elementwise
# passes make up for up to 256 rows in bf16. With quantized layers, the rows the quantized kernels
# take (pagedllm.quantization.native.kernel_rows: 16 on AVX-512 BF16, up to 256 on AVX2; w8a8's any
# number where its kernel has a batch form, every AVX-512 build), beyond which the torch path takes
# their batch paths, and with dense layers beside them no more than the dtype's rows
# (quantized_rows); all of it capped at MAX_ROWS. w8a8 steps of up to 256 rows in the fused call
# ran level with 16 on the 128-request workload (Zen 4 class, docs/quantization.md). On CPUs with AVX2 + FMA but no AVX-512, where the small-M
# kernel's float32 form beats oneDNN's GEMM up to 128 rows (native_linear.SMALL_M), the float32
# step does so too (2-core Zen 1 host, same benchmark, the torch path's GEMMs through that kernel
# up to 128 rows: 1.50x at 16 rows, 1.18x at 32, 1.16-1.18x at 48-64, 1.13x at 96, 1.04x at 128,
# 1.03x at 192), so there it takes up to 128 rows. bf16 there (the small-M kernel widening bf16 to
# float32 in registers, up to 256 rows) keeps MAX_ROWS, and so does float16 (the same kernel loop on
# F16C-widened values; dense layers only). On CPUs with AMX-BF16 the step's bf16
# GEMMs run on AMX tiles from 2 rows (small_m_gemm.c) and the step beats the torch path (whose GEMMs
# are the same tiles up to 128 rows, oneDNN's AMX GEMM above) at every row count (2-core Xeon, same
# benchmark: 1.9x at 1 row, 1.8x at 16, 1.35x at 32, 1.2x at 128, 1.15x at 256). float16 in the
# AVX-512 form (W widened by vcvtph2ps, float32 FMAs) against the torch path (oneDNN's AVX-512 FP16
# GEMM from 65 rows), same Xeon: 2.4x at 1 row, 1.9x at 16, 1.2x at 32, 1.05x at 64, 1.01x at 128,
# 0.94x at 256, so it takes up to 128 rows.
DTYPE_ROWS = {torch.float32: 32 if AVX512_FORM else 128, torch.bfloat16: MAX_ROWS,
              torch.float16: 128 if AVX512_FORM else MAX_ROWS}
# The quantized LM head's decode rows the step ends with (where the torch path's head runs the same
# kernel call).
QUANTIZED_HEAD_ROWS = 4

_pp = ctypes.POINTER(ctypes.c_void_p)
# linear_quant.c's layouts (its BITS values; 9: w8a8's row-major int8 codes); 0: the dense weight.
_DENSE, _E4M3, _INT4, _INT8, _W8A8 = 0, 3, 4, 8, 9
# How a quantized layer takes its activations (llama_decode.c's ACT_*): bf16, int8 per block of 32
# (the tiled codes' VNNI path), int8 with one scale per row (w8a8).
_ACT_BF16, _ACT_INT8_BLOCK, _ACT_INT8_ROW = 0, 1, 2


@lru_cache(maxsize=1)
def load_decode_kernel() -> Binding | None:
    """The fused decode step's library (llama_decode.c, which includes the attention, small-M GEMM,
    elementwise and quantized kernels), or None."""
    return native.load(kernels.DECODE)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(dim=-1) of [S, V] float32 or bfloat16 rows on the CPU (int64 [S]; the first index on
    ties, the first NaN where a row has one, as torch), one vectorized pass per row with the rows
    spread over the threads; None where the kernel does not apply (the caller runs torch's, which
    is scalar here: 3.7 ms against 0.4 for 128 rows of SmolLM2's 49,152 float32 logits)."""
    if (x.dim() != 2 or x.dtype not in _ARGMAX_DTYPES or x.device.type != "cpu" or x.stride(1) != 1
            or x.shape[1] < 1 or x.requires_grad):
        return None
    lib = load_decode_kernel()
    if lib is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], _DTYPE_CODES[x.dtype], out.data_ptr()):
        return None
    return out


def quantized_rows(kinds: set[int], dtype: torch.dtype) -> int:
    """Most rows of a fused step over linear layers of these kinds (linear_quant.c's BITS, _W8A8;
    _DENSE): the rows of each quantized kernel, and the dtype's where dense ones are among them."""
    rows = [kernel_rows(k) for k in kinds if k != _DENSE] + ([DTYPE_ROWS[dtype]] if _DENSE in kinds else [])
    return min(*rows, MAX_ROWS)


def _linear_layout(lin: nn.Module, dtype: torch.dtype
                   ) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | str:
    """(kind, group size, codes, scales, zeros, input order or None) of a quantized linear layer the
    C step runs with the kernel its LinearMethod calls; (0, ...) for a dense one; or why it cannot."""
    from pagedllm.quantization.methods import (
        Fp8LinearMethod,
        GroupCodesLinearMethod,
        Int4LinearMethod,
        Int8LinearMethod,
        W8A8LinearMethod,
    )

    qm = lin.quant_method
    qm = getattr(qm, "base_method", qm)  # under a LoRA wrapper: the base layer (adapter steps run eager)
    if type(qm) is UnquantizedLinearMethod:
        if lin.weight.dtype != dtype:
            return f"a linear weight in {lin.weight.dtype}"
        return _DENSE, 0, lin.weight, lin.weight, lin.weight, None
    name = getattr(qm, "name", type(qm).__name__)
    if isinstance(qm, GroupCodesLinearMethod) and getattr(lin, "kernel", None) == "dense":
        # group codes expanded once to the model dtype (groups the native kernel does not take)
        if lin.dense.dtype != dtype:
            return f"an expanded {name} weight in {lin.dense.dtype}"
        return _DENSE, 0, lin.dense, lin.dense, lin.dense, None
    if not getattr(lin, "native", False):
        return f"{name} linear layers without the native quantized kernel"
    k = lin.in_features
    if isinstance(qm, W8A8LinearMethod):  # fp32 scales [N]; the "zeros" are the codes' int32 row sums
        return _W8A8, k, lin.qweight, lin.wscale, lin.wsum, None
    if type(qm) is Int8LinearMethod:
        return _INT8, k, lin.qweight, lin.wscale, lin.wzero, None
    if type(qm) is Fp8LinearMethod:
        return _E4M3, k, lin.qweight, lin.wscale, lin.wzero, None
    if isinstance(qm, (Int4LinearMethod, GroupCodesLinearMethod)):
        perm = lin.perm
        if lin.kernel == "int4":
            return _INT4, lin.group_size, lin.packed, lin.qscales, lin.qzeros, perm
        if lin.kernel == "e4m3":
            return _E4M3, lin.group_size, lin.qcodes, lin.qscales, lin.qzeros, perm
        return _INT8, lin.group_size, lin.qcodes, lin.qscales, lin.qzeros, perm
    return f"{name} linear layers"


def _unsupported_reason(model: nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why the fused step cannot run this model, or None when it can."""
    from pagedllm.layers.rotary import RotaryEmbedding
    from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP

    gemma = _is_gemma3(model)
    if not gemma and (not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward):
        return f"{type(model).__name__} is not a Llama-family decoder or Gemma 3"
    if dtype not in _DTYPE_CODES:
        return f"dtype {dtype} (float32, bfloat16 and float16 only)"
    if kv_dtype != dtype:
        return f"KV cache dtype {kv_dtype} differs from the model dtype"
    p = model.parallel
    if p.tp.size != 1 or p.pp_size != 1:
        return "tensor or pipeline parallelism"
    if gemma and (dtype == torch.float16 or model.layers[0].self_attn.rotary_emb.cos.dtype != dtype):
        return "Gemma 3 in float16 (its norms and GELU run in float32 and bfloat16 only)"
    layer_types = _layer_types()
    reason = moe_reason([layer.mlp for layer in model.layers], dtype)
    if reason is not None:
        return reason
    for layer in model.layers:
        # Exactly the layers the C step computes (_layer_types): other families built on the Llama
        # layer (Phi-3's partial rotary, mixture-of-experts blocks, Qwen3-MoE) change what it would
        # have to compute.
        mlp_ok = type(layer.mlp) is (_gemma3_classes()[2] if gemma else LlamaMLP) or is_moe(layer.mlp)
        if (layer_types.get(type(layer)) is not type(layer.self_attn) or type(layer.self_attn.rotary_emb) is not
                RotaryEmbedding or not mlp_ok):
            return f"layer type {type(layer).__name__}"
        a, mlp = layer.self_attn, layer.mlp
        if _has_qk_norm(a) != _has_qk_norm(model.layers[0].self_attn):
            return "layers with and without q/k norms"
        if _has_qk_norm(a):
            eps = layer.input_layernorm.eps
            for norm in (a.q_norm, a.k_norm):
                w = norm.weight
                if norm.eps != eps or w.dtype != dtype or w.shape != (a.head_dim,) or not w.is_contiguous():
                    return "q/k norms of another eps, dtype or size than the step's"
        if gemma:
            reason = _gemma3_layer_reason(model, layer, dtype)
            if reason is not None:
                return reason
        for lin in (a.qkv_proj, a.o_proj) + (() if is_moe(mlp) else (mlp.gate_up_proj, mlp.down_proj)):
            layout = _linear_layout(lin, dtype)
            if isinstance(layout, str):
                return layout
        if a.head_dim > 1024 or a.attn.k_scale != 1.0 or a.attn.v_scale != 1.0:
            return "head size or KV scales"
        if a.attn.sliding_window is not None and not gemma:
            return "layers with windows of their own (the step takes one window for all)"
    return None


def _gemma3_classes() -> tuple[type, type, type]:
    """Gemma 3's model, layer and MLP classes."""
    from pagedllm.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3MLP

    return Gemma3ForCausalLM, Gemma3DecoderLayer, Gemma3MLP


def _is_gemma3(model: nn.Module) -> bool:
    """Gemma 3's text decoder with its own forward (the C step's Gemma form computes exactly it)."""
    cls = _gemma3_classes()[0]
    return type(model) is cls and type(model).forward is cls.forward


def _gemma3_layer_reason(model: nn.Module, layer: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the step's Gemma form cannot run this Gemma 3 layer (norms of one eps, in the dtype, of
    the hidden size; RoPE tables as long as the step's), or None."""
    eps = layer.input_layernorm.eps
    norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm, model.norm)
    for norm in norms:
        w = norm.weight
        if norm.eps != eps or w.dtype != dtype or w.shape != (model.config.hidden_size,) or not w.is_contiguous():
            return "Gemma norms of another eps, dtype or size than the step's"
    rot = layer.self_attn.rotary_emb
    if rot.cos.shape != model.layers[0].self_attn.rotary_emb.cos.shape or rot.cos.dtype != dtype:
        return "RoPE tables of another length or dtype than the first layer's"
    return None


def _layer_types() -> dict[type, type]:
    """The decoder layer classes the C step computes, each with its exact attention class: the
    Llama layer, Qwen3's (the Llama layer with per-head q/k RMSNorm before RoPE) and Gemma 3's."""
    from pagedllm.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer
    from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer
    from pagedllm.models.moe import MixtralDecoderLayer, Qwen3MoeDecoderLayer
    from pagedllm.models.qwen3 import QKNormAttention, Qwen3DecoderLayer

    return {LlamaDecoderLayer: LlamaAttention, Qwen3DecoderLayer: QKNormAttention, Gemma3DecoderLayer: Gemma3Attention,
            Qwen3MoeDecoderLayer: QKNormAttention, MixtralDecoderLayer: LlamaAttention}


def _has_qk_norm(attn: nn.Module) -> bool:
    """Whether this attention (of a layer _layer_types accepts) norms each q and k head before RoPE."""
    from pagedllm.models.gemma3 import Gemma3Attention
    from pagedllm.models.qwen3 import QKNormAttention

    return type(attn) in (QKNormAttention, Gemma3Attention)


class NativeDecode:
    """The fused decode step bound to one model and its KV caches."""

    def __init__(self, lib: Binding, model: nn.Module, kv_caches: list[torch.Tensor], dtype: torch.dtype,
                 block_size: int, sliding_window: int | None, groups: KVCacheGroups | None = None) -> None:
        self.lib = lib
        self.guard = StallGuard(torch.get_num_threads())
        self.dtype = dtype
        cfg = model.config
        layers = list(model.layers)
        attn0 = layers[0].self_attn
        rotary = attn0.rotary_emb
        self._keep: list[object] = []  # the pointer arrays live as long as this object
        self.kinds: set[int] = set()  # the linear layers' kinds

        def ptrs(tensors: list[torch.Tensor | None]) -> ctypes.Array:
            arr = (ctypes.c_void_p * len(tensors))(*(0 if t is None else t.data_ptr() for t in tensors))
            self._keep.append(arr)
            return ctypes.cast(arr, _pp)

        def lin(name: str) -> tuple[ctypes.Array, ctypes.Array, object]:
            """Dense weights (None where quantized), biases, and the descriptors (None: all dense)."""
            # (a mixture-of-experts layer has no gate_up_proj / down_proj: None, bound by bind_moe)
            mods = [getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name, None)
                    for layer in layers]
            layouts = [(_DENSE, 0, None, None, None, None) if m is None else _linear_layout(m, dtype) for m in mods]
            descs = (_QuantLinear * len(mods))()
            for d, (kind, group, codes, scales, zeros, perm) in zip(descs, layouts):  # type: ignore[misc]
                if kind != _DENSE:
                    d.kind, d.group, d.perm = kind, group, 0 if perm is None else perm.data_ptr()
                    # the LinearMethods' choice; w8a8 quantizes per row
                    d.int8_act = _ACT_INT8_ROW if kind == _W8A8 else int(int8_activations())
                    d.codes, d.scales, d.zeros = codes.data_ptr(), scales.data_ptr(), zeros.data_ptr()
                    self._keep.extend([codes, scales, zeros, perm])
            self._keep.append(descs)
            dense = [lay[0] == _DENSE for lay in layouts]  # type: ignore[index]
            self.kinds.update(lay[0] for lay in layouts)  # type: ignore[misc]
            weights = ptrs([lay[2] if d else None for lay, d in zip(layouts, dense)])  # type: ignore[index]
            q = None if all(dense) else ctypes.cast(descs, ctypes.POINTER(_QuantLinear))
            return weights, ptrs([getattr(m, "bias", None) for m in mods]), q

        qkv_w, qkv_b, qkv_q = lin("qkv_proj")
        o_w, o_b, o_q = lin("o_proj")
        gu_w, gu_b, gu_q = lin("gate_up_proj")
        down_w, down_b, down_q = lin("down_proj")
        self.quantized = any(q is not None for q in (qkv_q, o_q, gu_q, down_q))
        self.hidden = int(cfg.hidden_size)
        # Layer l's K/V cache: kv_caches[l], or with KV layer groups the tensor of its slot.
        groups = groups or single_group(len(layers))
        self.num_groups = groups.num_groups
        caches = [kv_caches[groups.layer_slot[layer.self_attn.attn.layer_idx]] for layer in layers]
        gemma = _is_gemma3(model)
        # Gemma 3: the MLP's input norm is pre_feedforward_layernorm (post_attention_layernorm norms
        # the attention's output); the Llama family's is post_attention_layernorm.
        mlp_norms = [layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm for layer in layers]
        self.model = _Model(
            num_layers=len(layers), hidden=self.hidden, num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads,
            head_dim=attn0.head_dim, intermediate=next((layer.mlp.gate_up_proj.out_features // 2 for layer in layers
                                                        if not is_moe(layer.mlp)), 0),
            dtype=_DTYPE_CODES[dtype], block_size=block_size, sliding_window=int(sliding_window or 0),
            max_position=rotary.cos.shape[0], eps=float(layers[0].input_layernorm.eps),
            attn_scale=float(attn0.attn.scale),
            embed=self._vocab_ptr(model.embed_tokens), final_norm=model.norm.weight.data_ptr(),
            cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr(),
            input_norm=ptrs([layer.input_layernorm.weight for layer in layers]),
            post_norm=ptrs([norm.weight for norm in mlp_norms]),
            qkv_w=qkv_w, qkv_b=qkv_b, o_w=o_w, o_b=o_b, gate_up_w=gu_w, gate_up_b=gu_b, down_w=down_w, down_b=down_b,
            k_cache=ptrs([kv[0] for kv in caches]), v_cache=ptrs([kv[1] for kv in caches]),
            qkv_q=qkv_q, o_q=o_q, gate_up_q=gu_q, down_q=down_q,
        )
        if _has_qk_norm(attn0):  # Qwen3, Gemma 3: the per-head q and k norms before RoPE
            self.model.q_norm = ptrs([layer.self_attn.q_norm.weight for layer in layers])
            self.model.k_norm = ptrs([layer.self_attn.k_norm.weight for layer in layers])
        if gemma:
            self._bind_gemma3(model, layers, ptrs)
        self.moe = bind_moe(self.model, [layer.mlp for layer in layers], ptrs)
        if self.num_groups > 1:
            self._layer_group = np.asarray([groups.layer_group[layer.self_attn.attn.layer_idx] for layer in layers],
                                           dtype=np.int64)
            self.model.layer_group = self._layer_group.ctypes.data
        embed = self._codes(model.embed_tokens)
        if embed is not None:  # the embedding kept as codes: the step expands the rows it looks up
            self.model.embed_q, self.model.embed_rows = ctypes.pointer(embed), model.embed_tokens.rows
            self.quantized = True
        head = model.lm_head
        # The step can end with the LM head where the torch path's head is the same small-M GEMM
        # (and the logits are the head's: no softcap after it).
        self.has_head = getattr(model, "final_logit_softcapping", None) is None and (
            head.quant_codes is not None and not head.dense or (
                head.weight.dtype == dtype and head.weight.is_contiguous() and head.weight.dim() == 2
                and head.weight.shape == (head.vocab_size, self.hidden)))
        if self.has_head:
            self.model.lm_head, self.model.vocab = self._vocab_ptr(head), head.vocab_size
            self.vocab = int(head.vocab_size)
            head_q = self._codes(head)
            if head_q is not None:  # the torch path's LMHead reads these for decode rows: so does the step
                self.model.lm_head_q = ctypes.pointer(head_q)
        # Everything the struct points at must stay alive and in place.
        self._keep.extend([model, kv_caches, caches, rotary.cos, rotary.sin])
        self.lora = self._bind_lora(layers)
        self.max_rows = quantized_rows(self.kinds, dtype) if self.quantized else DTYPE_ROWS[dtype]
        head_rows = QUANTIZED_HEAD_ROWS if self.has_head and self.model.lm_head_q else small_m_rows(dtype)
        self.max_head_rows = min(self.max_rows, head_rows)

    def _bind_gemma3(self, model: nn.Module, layers: list[nn.Module], ptrs) -> None:  # noqa: ANN001
        """Gemma 3's part of the step: its norms and GELU, the embedding scale, the norms of the
        sublayers' outputs, and each layer's window and RoPE tables (those of its kind)."""
        md = self.model
        md.gemma, md.embed_scale = 1, float(model.embed_scale)
        md.attn_out_norm = ptrs([layer.post_attention_layernorm.weight for layer in layers])
        md.mlp_out_norm = ptrs([layer.post_feedforward_layernorm.weight for layer in layers])
        self._windows = np.asarray([layer.self_attn.attn.sliding_window or 0 for layer in layers], dtype=np.int64)
        md.layer_window = self._windows.ctypes.data
        md.layer_cos = ptrs([layer.self_attn.rotary_emb.cos for layer in layers])
        md.layer_sin = ptrs([layer.self_attn.rotary_emb.sin for layer in layers])
        self._keep.extend([layer.self_attn.rotary_emb for layer in layers])

    def _bind_lora(self, layers: list[nn.Module]) -> bool:
        """Binds the LoRA slots of every layer's four linear layers (their LinearMethods wrapped by
        pagedllm/lora/layers.py, with --enable-lora): the step then adds the deltas of the rows
        with an adapter after each base GEMM (lora.c's block kernels, the same bits as the torch
        path's native LoRA call). False where there are none or the step cannot apply them."""
        fields = (("lora_qkv", "self_attn", "qkv_proj"), ("lora_o", "self_attn", "o_proj"),
                  ("lora_gate_up", "mlp", "gate_up_proj"), ("lora_down", "mlp", "down_proj"))
        if self.moe:  # the experts have no LoRA slots here (steps with adapter rows run the torch path)
            return False
        methods = [[getattr(getattr(layer, part), name).quant_method for layer in layers] for _, part, name in fields]
        if not all(hasattr(m, "lora_a") for ms in methods for m in ms):
            return False
        first = methods[0][0]
        codes = {torch.float32: 0, torch.bfloat16: 1}
        if (first.lora_a.dtype not in codes or self.dtype not in codes
                or any(m.lora_a.dtype != first.lora_a.dtype or m.max_rank != first.max_rank or len(m.ranges) > 3
                       for ms in methods for m in ms)):
            return False
        for (field, _, _), ms in zip(fields, methods):
            arr = (_LoraLinear * len(ms))()
            for d, m in zip(arr, ms):
                d.a, d.bt, d.ranges, d.num_slices = (m.lora_a.data_ptr(), m.lora_bt.data_ptr(), m.ranges.data_ptr(),
                                                     len(m.ranges))
                if m.lora_ap is not None:  # the AMX tiles' copies (lora_amx.h)
                    d.ap, d.bp = m.lora_ap.data_ptr(), m.lora_bp.data_ptr()
                self._keep.extend([m.lora_a, m.lora_bt, m.ranges, m.lora_ap, m.lora_bp])
            self._keep.append(arr)
            setattr(self.model, field, ctypes.cast(arr, ctypes.POINTER(_LoraLinear)))
        self.model.lora_rank, self.model.lora_dtype = first.max_rank, codes[first.lora_a.dtype]
        return True

    def _codes(self, mod: nn.Module) -> _QuantLinear | None:
        """The descriptor of a vocabulary module's codes (embedding or LM head), or None (dense)."""
        q = mod.quant_codes
        if q is None:
            return None
        bits, group, codes, scales, zeros = q
        desc = _QuantLinear(kind=bits, group=group, codes=codes.data_ptr(),  # the layouts' codes are their bits
                            scales=scales.data_ptr(), zeros=zeros.data_ptr(), perm=0, int8_act=int(int8_activations()))
        self._keep.extend([codes, scales, zeros, desc])
        return desc

    @staticmethod
    def _vocab_ptr(mod: nn.Module) -> int:
        """The dense weight, or (codes only) the codes: never read densely, but not NULL."""
        return mod.weight.data_ptr() if mod.dense else mod.quant_codes[2].data_ptr()

    @classmethod
    def create(cls, model: nn.Module, kv_caches: list[torch.Tensor], dtype: torch.dtype, kv_dtype: torch.dtype,
               block_size: int, sliding_window: int | None, groups: KVCacheGroups | None = None) -> NativeDecode | None:
        """The fused step for this model, or None (logged) where it does not apply. `groups`: the
        KV cache's layer groups (core/kv_groups.py; kv_caches then holds one tensor per slot), or
        None for one tensor per layer and one block table."""
        lib = load_decode_kernel()
        if lib is None:
            return None
        avail = lib.small_m_available()
        reason = _unsupported_reason(model, dtype, kv_dtype)
        if reason is None and not avail & 1:
            reason = "the CPU has neither AVX-512 nor AVX2 with FMA"
        if reason is None and dtype == torch.bfloat16 and not avail & 2:
            reason = "no bf16 GEMM kernel for this CPU (AVX-512 without AVX-512 BF16)"
        if reason is None and dtype == torch.float16 and not avail & 8:
            reason = "no float16 GEMM kernel for this CPU (no F16C)"
        if reason is not None:
            logger.info("decode steps run as torch ops: %s", reason)
            return None
        # Quantized layers or vocab codes exist here only in the native kernel's layouts, which the
        # LinearMethods choose where that kernel loads (_linear_layout gives the reason otherwise).
        nd = cls(lib, model, kv_caches, dtype, block_size, sliding_window, groups)
        if dtype == torch.float16 and (nd.quantized or nd.model.lm_head_q):
            # the quantized kernels take float32 or bf16 activations (llama_decode.c refuses these)
            logger.info("decode steps run as torch ops: float16 with quantized layers or vocabulary")
            return None
        logger.info("decode steps of up to %d rows run as one native call per step%s", nd.max_rows,
                    " (quantized linear layers through the native quantized kernel)" if nd.quantized else "")
        return nd

    def applies(self, num_tokens: int, num_reqs: int, has_dense: bool) -> bool:
        """A decode-only step (one token per request) of at most max_rows rows."""
        return num_tokens == num_reqs and 0 < num_reqs <= self.max_rows and not has_dense

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_tables: np.ndarray, seq_lens: np.ndarray, lora_slots: np.ndarray | None = None,
            kv_groups: list | None = None) -> torch.Tensor | None:
        """Final normed hidden states [M, hidden], or None when the kernel declines the step (then
        the KV cache is untouched and the torch path runs it). `lora_slots`: each row's LoRA
        slot (int32, -1: none; the caller keeps it alive over the call), or None. `kv_groups`:
        with KV layer groups, the batch's KVGroupArrays of groups 1 .. G - 1 (slot_mapping and
        block_tables are group 0's)."""
        self.model.lora_slots = None if lora_slots is None else lora_slots.ctypes.data
        M = len(input_ids)
        out = torch.empty(M, self.hidden, dtype=self.dtype)
        arrays = _step_arrays(input_ids, positions, slot_mapping, block_tables, seq_lens)
        keep = self._bind_groups(arrays, kv_groups)  # noqa: F841 (alive over the call)
        rc = self._guarded(2 * M, self.lib.llama_decode_step, ctypes.byref(self.model), M, *_pointers(arrays),
                           out.data_ptr())
        return out if rc == 0 else None

    def _bind_groups(self, arrays: list[np.ndarray], kv_groups: list | None) -> list[object]:
        """Points the step at each KV group's slots and block tables (group 0's: the step's own
        `arrays`); returns what must stay alive over the call."""
        if self.num_groups == 1:
            return []
        if kv_groups is None or len(kv_groups) != self.num_groups - 1:
            raise ValueError(f"kv_groups={None if kv_groups is None else len(kv_groups)}: the step's KV cache has "
                             f"{self.num_groups} layer groups, so it takes the block tables of {self.num_groups - 1} "
                             "groups besides the first")
        slots = [arrays[2]] + [np.ascontiguousarray(g.slot_mapping, dtype=np.int64) for g in kv_groups]
        tables = [arrays[3]] + [np.ascontiguousarray(g.block_tables, dtype=np.int64) for g in kv_groups]
        for t in tables[1:]:
            if t.shape != tables[0].shape:
                raise ValueError(f"block tables of shape {t.shape}: every KV group's must be {tables[0].shape}")
        slot_ptrs = (ctypes.c_void_p * len(slots))(*(a.ctypes.data for a in slots))
        table_ptrs = (ctypes.c_void_p * len(tables))(*(a.ctypes.data for a in tables))
        self.model.group_slots = ctypes.cast(slot_ptrs, _pp)
        self.model.group_tables = ctypes.cast(table_ptrs, _pp)
        return [slots, tables, slot_ptrs, table_ptrs]

    def _guarded(self, key: int, fn, *args) -> int:  # noqa: ANN001
        """One C step on the threads the stall guard chooses, its time reported back to the guard
        (`key`: the step's size, see StallGuard.record). Returns the C function's code."""
        threads = self.model.threads = self.guard.threads()
        t0 = time.perf_counter()
        rc = fn(*args)
        if rc == 0:
            self.guard.record(key, threads, time.perf_counter() - t0)
        return rc

    def head_applies(self, num_sample_rows: int) -> bool:
        """Whether `run_head` can end this step: the LM head is bound and the torch path would
        compute these rows' logits with the same GEMM (at most max_head_rows rows)."""
        return self.has_head and 0 < num_sample_rows <= self.max_head_rows

    def run_head(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 block_tables: np.ndarray, seq_lens: np.ndarray, sample_rows: np.ndarray,
                 greedy: bool, mask: torch.Tensor | None = None,
                 mask_rows: np.ndarray | None = None, lora_slots: np.ndarray | None = None,
                 kv_groups: list | None = None) -> np.ndarray | torch.Tensor | None:
        """The step on to the LM head for the batch rows `sample_rows`: their argmax token ids [S]
        (int64) when `greedy`, else their float32 logits [S, vocab], equal to what the torch path's
        LM head gives for the same hidden states. With a structured-output `mask` (int32 [R, words])
        and `mask_rows` [S] (each sample row's mask row, -1 for none), the tokens a row's mask does
        not allow are -inf in its logits and never its argmax. None when the kernel declines the
        step (then the KV cache is untouched and the torch path runs it). `lora_slots` and
        `kv_groups` as for run."""
        self.model.lora_slots = None if lora_slots is None else lora_slots.ctypes.data
        arrays = _step_arrays(input_ids, positions, slot_mapping, block_tables, seq_lens)
        keep = self._bind_groups(arrays, kv_groups)  # noqa: F841 (alive over the call)
        rows = np.ascontiguousarray(sample_rows, dtype=np.int64)
        S = len(rows)
        tokens = np.empty(S, dtype=np.int64) if greedy else None
        logits = None if greedy else torch.empty(S, self.vocab, dtype=torch.float32)
        if mask is not None:
            mask = mask.contiguous()
            mask_rows = np.ascontiguousarray(mask_rows, dtype=np.int64)
        rc = self._guarded(
            2 * len(input_ids) + 1, self.lib.llama_decode_head, ctypes.byref(self.model), len(input_ids),
            *_pointers(arrays), S, rows.ctypes.data, None if logits is None else logits.data_ptr(),
            None if tokens is None else tokens.ctypes.data, None if mask is None else mask.data_ptr(),
            0 if mask is None else mask.stride(0), None if mask_rows is None else mask_rows.ctypes.data)
        if rc != 0:
            return None
        return tokens if greedy else logits


def _step_arrays(input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 block_tables: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray]:
    """The step's arrays as contiguous int64 (the batch's arrays already are: no copy then); the
    caller keeps them alive over the C call."""
    return [np.ascontiguousarray(a, dtype=np.int64) for a in (input_ids, positions, slot_mapping, block_tables,
                                                              seq_lens)]


def _pointers(arrays: list[np.ndarray]) -> tuple[int, ...]:
    """(input_ids, positions, slot_mapping, block_tables, block table stride, seq_lens): the C
    functions' argument order."""
    ids, pos, slots, table, lens = arrays
    return ids.ctypes.data, pos.ctypes.data, slots.ctypes.data, table.ctypes.data, table.shape[1], lens.ctypes.data
