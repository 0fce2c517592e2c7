"""One LinearMethod per scheme: ``create_weights`` / ``process_weights_after_loading`` / ``apply``.

On-the-fly schemes (``int8``, ``w8a8``, ``int4``, ``fp8``) load the float weight like the
unquantized method and quantize it once after loading, dropping the float copy. Pre-quantized
checkpoints (GGUF, AWQ, GPTQ) load group-wise codes, scales and zeros (``w = code * scale +
zero``) decoded from their own layouts by :mod:`pagedllm.quantization.formats`, which the same
``process_weights_after_loading`` turns into the kernel's layout.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.quantization import kernels as K
from pagedllm.quantization import native
from pagedllm.quantization.formats import E4M3, GroupCodes

# The native kernel's ``bits`` for each group-codes kernel (finish_group_codes' layer.kernel).
_KERNEL_BITS = {"int4": 4, "int8_group": 8, "e4m3": E4M3}

logger = logging.getLogger(__name__)


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _set(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    """A runtime tensor of the layer (a buffer: not a parameter, not saved)."""
    layer.register_buffer(name, value, persistent=False)


def runtime_bytes(layer: nn.Module) -> int:
    """Bytes of the layer's weight as it is kept in memory (parameters and buffers, no bias)."""
    tensors = [t for n, t in layer.named_parameters(recurse=False) if n != "bias"]
    tensors += list(layer.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors)


class _FromFloat:
    """Loads the float weight as the unquantized method does; quantizes it after loading."""

    name = "float"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        del layer.weight
        self.quantize(layer, w)

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        raise NotImplementedError


class _PerChannel(_FromFloat):
    """Weight-only, one scale per output channel: ``quantizer(w) -> (codes, scales)`` at load,
    ``kernel(x, codes, scales)`` per call."""

    quantizer = staticmethod(K.quantize_int8_per_channel)
    kernel = staticmethod(K.int8_weight_linear)
    scale_dtype: torch.dtype | None = torch.bfloat16
    """dtype of the scales the kernel takes (None: the model dtype)."""

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        codes, scales = self.quantizer(w)
        _set(layer, "qweight", codes)
        _set(layer, "wscale", scales.to(self.scale_dtype or self.dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _bias(self.kernel(x, layer.qweight, layer.wscale), bias)


class Int8LinearMethod(_PerChannel):
    """Weight-only int8, one scale per output channel: where the CPU has the native kernel, its
    tiled codes for every batch (the kernel for decode rows, the weight expanded once per call for
    oneDNN above: faster than ``_weight_int8pack_mm`` at batch sizes, docs/quantization.md);
    otherwise ``_weight_int8pack_mm`` on the codes and bf16 scales."""

    name = "int8"

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        layer.native = native.fits(w.shape[1], w.shape[1])
        if not layer.native:
            super().quantize(layer, w)
            return
        codes, scales = self.quantizer(w)
        packed, s, z = native.pack_int8_native(codes, scales[:, None], torch.zeros(w.shape[0], 1))
        _set(layer, "qweight", packed)
        _set(layer, "wscale", s)
        _set(layer, "wzero", z)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.native:
            return _bias(native.group_linear(x, layer.qweight, layer.wscale, layer.wzero, bits=8,
                                             n=layer.out_features), bias)
        return super().apply(layer, x, bias)


class W8A8LinearMethod(_FromFloat):
    """int8 weights (per channel) and int8 activations (per token, dynamic), int32 accumulation.

    One copy of the codes, [N, K] row-major. The native kernel takes every call where it has a batch
    form (AVX-512 builds: AMX tiles, or vpdpbusd over 16 x 16 blocks, from 5 rows; up to 4 rows its
    row form), else up to ``native.w8a8_rows()`` rows (the AVX2 form: 256), with the same
    activation quantization and the same result to the bit as the torch formula; ``wsum`` (int32
    row sums of the codes, 4 bytes per output row) is the kernel's. Larger batches of the AVX2
    form quantize their rows and scale the int32 sums in the kernel, around
    ``torch._int_mm`` (or exact float32 GEMMs without VNNI) on the codes' transpose (a view).
    Without the kernel the torch formula (kernels.int8_dynamic_linear) runs."""

    name = "w8a8"

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        self.finish(layer, *K.quantize_int8_per_channel(w))

    @staticmethod
    def finish(layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Runtime tensors from int8 codes [N, K] and float32 scales [N]."""
        _set(layer, "qweight", codes)
        _set(layer, "wscale", scales)
        layer.native = native.load_quant_kernel() is not None
        if layer.native:
            _set(layer, "wsum", codes.sum(dim=1, dtype=torch.int32))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.native:
            return _bias(native.w8a8_linear(x, layer.qweight, layer.wscale, layer.wsum), bias)
        return _bias(K.int8_dynamic_linear(x, layer.qweight.t(), layer.wscale), bias)


class StoredW8A8LinearMethod(W8A8LinearMethod):
    """w8a8 on a checkpoint's own int8 codes and per-row scales (compressed-tensors INT8 W8A8)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        layer.codes = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        layer.scales = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, scales = layer.codes.data, layer.scales.data
        del layer._parameters["codes"], layer._parameters["scales"]
        self.finish(layer, codes, scales)


class Fp8LinearMethod(_PerChannel):
    """e4m3 weights with one scale per output channel, widened to bfloat16 inside the native kernel
    where the CPU has it (any batch), else widened to the activation dtype per call in torch."""

    name = "fp8"
    scale_dtype = None
    quantizer = staticmethod(K.quantize_fp8_per_channel)
    kernel = staticmethod(K.fp8_weight_linear)

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        super().quantize(layer, w)
        layer.native = native.fits(w.shape[1], w.shape[1])
        if layer.native:
            _set(layer, "wscale", layer.wscale.to(torch.bfloat16).unsqueeze(1).contiguous())
            _set(layer, "wzero", torch.zeros(w.shape[0], 1, dtype=torch.bfloat16))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.native:
            return _bias(native.group_linear(x, layer.qweight.view(torch.uint8), layer.wscale, layer.wzero, bits=3,
                                             n=layer.out_features), bias)
        return super().apply(layer, x, bias)


class Int4LinearMethod(_FromFloat):
    """Weight-only 4-bit, asymmetric, one scale and zero per group of ``group_size`` inputs."""

    name = "int4"

    def __init__(self, group_size: int, clip_search: bool = False) -> None:
        self.group_size = group_size
        self.clip_search = clip_search

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        # A group size that does not divide the input size falls back to the largest one below it that does
        # (SmolLM2's 576 inputs take groups of 64 under --quantization-group-size 128).
        fitting = [g for g in K.INT4_GROUP_SIZES if g <= self.group_size and in_features % g == 0]
        if not fitting:
            raise ValueError(f"int4: no group size in {K.INT4_GROUP_SIZES} divides the input size {in_features}")
        if fitting[-1] != self.group_size:
            logger.debug("int4: %d inputs use groups of %d instead of %d", in_features, fitting[-1], self.group_size)
        self.group_size = fitting[-1]
        super().create_weights(layer, in_features, out_features, dtype)

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        codes, scales, zeros = K.quantize_groupwise(w, self.group_size, 4, self.clip_search)
        finish_group_codes(layer, codes, scales, zeros, bits=4, dtype=self.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_group_codes(layer, x, bias)


class GroupCodesLinearMethod:
    """Pre-quantized group-wise weights (GGUF blocks, AWQ, GPTQ, compressed-tensors; FP8 checkpoints
    as e4m3 bytes with ``bits`` :data:`E4M3`), kept at ``bits`` per weight.

    Loads ``codes`` [N, K] (uint8), ``scales`` and ``zeros`` [N, K/g] (float32) and, for GPTQ
    with act-order, ``perm`` [K]: the input order that makes each group contiguous.
    """

    def __init__(self, name: str, bits: int, group_size: int, act_order: bool = False) -> None:
        self.name, self.bits, self.group_size, self.act_order = name, bits, group_size, act_order

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        if in_features % self.group_size:
            raise ValueError(
                f"{self.name}: group size {self.group_size} does not divide the input size {in_features}"
            )
        groups = in_features // self.group_size
        self.dtype = dtype
        layer.codes = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8), requires_grad=False)
        layer.scales = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        layer.zeros = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        for p in (layer.scales, layer.zeros):
            p.weight_loader = _group_loader(layer)  # type: ignore[attr-defined]
        if self.act_order:
            if layer.input_parallel and layer.tp.size > 1:
                raise ValueError(f"{self.name}: act-order (g_idx) weights cannot be split by input columns over "
                                 f"{layer.tp.size} tensor-parallel ranks; run them with tensor_parallel_size=1 "
                                 "(pipeline parallelism splits by layers)")
            layer.perm = nn.Parameter(torch.full((in_features,), -1, dtype=torch.int64), requires_grad=False)
            layer.perm.weight_loader = _load_shared_perm  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, scales, zeros = layer.codes.data, layer.scales.data, layer.zeros.data
        perm = layer.perm.data if self.act_order else None
        for name in ("codes", "scales", "zeros", "perm"):
            if name in layer._parameters:
                del layer._parameters[name]
        finish_group_codes(layer, codes, scales, zeros, bits=self.bits, dtype=self.dtype, perm=perm)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_group_codes(layer, x, bias)


def _group_loader(layer: nn.Module):
    """Scales/zeros of a shard with coarser groups than the fused layer (a GGUF Q4_K q_proj fused
    with a Q6_K v_proj) repeat each group's value over the finer groups."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        groups = param.shape[1]
        if loaded.dim() == 2 and loaded.shape[1] != groups and loaded.shape[1] and groups % loaded.shape[1] == 0:
            loaded = loaded.repeat_interleave(groups // loaded.shape[1], dim=1)
        layer.weight_loader(param, loaded, shard_id)

    return load


def _load_shared_perm(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """act-order input permutation: every shard of a fused layer must carry the same one."""
    if param.data[0] >= 0 and not torch.equal(param.data, loaded):
        raise ValueError(
            f"shard {shard_id!r} of a fused layer has a g_idx (act-order) different from the other "
            "shards'; such a checkpoint cannot share one input order"
        )
    param.data.copy_(loaded)


def finish_group_codes(layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int, dtype: torch.dtype, perm: torch.Tensor | None = None) -> None:
    """Kernel layout: 4-bit codes in the native kernel's layout (CPUs with AVX-512
    BF16 or AVX2 + FMA) or packed for
    ``_weight_int4pack_mm_for_cpu``, where the group size allows it; otherwise, where the native
    kernel runs but not this group size, the weight expanded once to the model dtype (kernel
    "dense"), and elsewhere int8 codes with per-group scales in the model dtype. e4m3 bytes (``bits`` :data:`E4M3`) stay as they are for the
    kernel, or are expanded once to the model dtype where it does not run."""
    group = codes.shape[1] // scales.shape[1]
    layer.group_size = group
    if perm is not None:
        _set(layer, "perm", perm.clone())
    else:
        layer.perm = None
    layer.native = native.fits(codes.shape[1], group)
    if bits == E4M3:  # e4m3 bytes, row-major, scales [N, K/g] (zeros 0)
        layer.kernel = "e4m3"
        if layer.native:
            _set(layer, "qcodes", codes.contiguous())
            _set(layer, "qscales", scales.to(torch.bfloat16).contiguous())
            _set(layer, "qzeros", zeros.to(torch.bfloat16).contiguous())
            return
        _set(layer, "dense", GroupCodes(codes, scales, zeros).dequantize(E4M3).to(dtype))
        return
    if bits <= 4 and (group in K.INT4_GROUP_SIZES or layer.native):
        layer.kernel = "int4"
        if layer.native:
            packed, s, z = native.pack_int4_native(codes, scales, zeros)
            _set(layer, "packed", packed)
            _set(layer, "qscales", s)
            _set(layer, "qzeros", z)
            return
        packed, sz = K.pack_int4(codes, scales, zeros)
        _set(layer, "packed", packed)
        _set(layer, "scales_zeros", sz)
        return
    if not layer.native and native.load_quant_kernel() is not None:
        # Groups the native kernel does not take (GGUF Q6_K / Q3_K / Q2_K: 16 weights a scale):
        # expanded once to the model dtype (in the layer's own input order), so that each step reads
        # 2 bytes a weight (the fused decode step takes the layer as a dense one) instead of
        # widening the codes on every call (which writes and reads the dense weight).
        layer.kernel = "dense"
        _set(layer, "dense", GroupCodes(codes, scales, zeros, perm).dequantize().to(dtype).contiguous())
        layer.perm = None
        return
    shift = 1 << (bits - 1)  # centred codes: the zero kept, zero + shift * scale, stays small
    centred = (codes.to(torch.int16) - shift).to(torch.int8)
    layer.kernel = "int8_group"
    if layer.native:
        packed, s, z = native.pack_int8_native(centred, scales, zeros + shift * scales)
        _set(layer, "qcodes", packed)
        _set(layer, "qscales", s)
        _set(layer, "qzeros", z)
        return
    _set(layer, "qcodes", centred)
    _set(layer, "qscales", scales.to(dtype))
    _set(layer, "qzeros", (zeros + shift * scales).to(dtype))


def apply_group_codes(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.perm is not None:
        x = x.index_select(-1, layer.perm)
    if layer.native:
        y = native.group_linear(x, layer.packed if layer.kernel == "int4" else layer.qcodes, layer.qscales,
                                layer.qzeros, bits=_KERNEL_BITS[layer.kernel], n=layer.out_features)
    elif layer.kernel == "dense":  # decode rows of a CPU step run the fused decode step's GEMM instead
        y = torch.nn.functional.linear(x, layer.dense if layer.dense.dtype == x.dtype else layer.dense.to(x.dtype))
    elif layer.kernel == "e4m3":
        y = torch.nn.functional.linear(x, layer.dense.to(x.dtype))
    elif layer.kernel == "int4":
        y = K.int4_linear(x, layer.packed, layer.scales_zeros, layer.group_size)
    else:
        y = K.int8_group_linear(x, layer.qcodes, layer.qscales, layer.qzeros)
    return _bias(y, bias)
