"""Quantized linear methods against float references, with tolerances derived from each scheme;
checkpoint decoders against independent producers (the gguf package, auto-round's packers)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.layers.linear import Linear
from pagedllm.quantization import kernels as K
from pagedllm.quantization.formats import (
    GGUF_TYPES,
    QuantFormatError,
    awq_group_codes,
    gguf_group_codes,
    gptq_group_codes,
)
from pagedllm.quantization.methods import (
    Fp8LinearMethod,
    GroupCodesLinearMethod,
    Int4LinearMethod,
    Int8LinearMethod,
    W8A8LinearMethod,
    runtime_bytes,
)
from pagedllm.quantization import native
from test_quant_native import _int8_act_bound

N, KDIM, M = 96, 256, 7
EPS = 1e-4  # float32 accumulation over KDIM terms of magnitude ~1


def _layer(method, w: torch.Tensor, bias: bool = True) -> Linear:
    layer = Linear(w.shape[1], w.shape[0], bias=bias, dtype=torch.float32, quant_method=method)
    if hasattr(layer, "weight"):
        layer.weight.data.copy_(w)
    if bias:
        layer.bias.data.copy_(torch.linspace(-1, 1, w.shape[0]))
    return layer


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, KDIM, generator=g) * 0.05, torch.randn(M, KDIM, generator=g)


def _ref(layer: Linear, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T + layer.bias


def test_int8_within_half_a_step_per_weight(data) -> None:
    w, x = data
    layer = _layer(Int8LinearMethod(), w)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") or "weight" not in layer._parameters
    step = w.abs().amax(dim=1) / 127
    # half a step per weight; the kernel takes bfloat16 activations and scales (relative 2^-9 each)
    bound = x.abs() @ (step[:, None] / 2).expand(N, KDIM).T + 2.0**-8 * (x.abs() @ w.abs().T) + EPS
    if layer.native:  # int8 activations where the kernel takes them (|code * scale| <= |w| + step / 2)
        bound = bound + _int8_act_bound(x, (w.abs() + step[:, None] / 2) * (1 + 2.0**-8), M)
    assert (layer(x) - _ref(layer, x, w)).abs().le(bound).all()
    # the native kernel's tiles hold code + 128 (uint8); torch's kernel reads int8 codes
    assert layer.qweight.dtype == (torch.uint8 if layer.native else torch.int8)


def test_w8a8_within_weight_and_activation_steps(data) -> None:
    w, x = data
    layer = _layer(W8A8LinearMethod(), w)
    layer.quant_method.process_weights_after_loading(layer)
    w_step = (w.abs().amax(dim=1) / 127)[:, None].expand(N, KDIM)
    x_step = (x.abs().amax(dim=1) / 127)[:, None].expand(M, KDIM)
    bound = x.abs() @ (w_step / 2).T + (x_step / 2) @ (w.abs() + w_step / 2).T + EPS
    assert (layer(x) - _ref(layer, x, w)).abs().le(bound).all()


def test_w8a8_keeps_one_copy_of_the_codes_for_decode_rows_and_batches(data) -> None:
    """Row-major int8 codes serve both paths: decode rows (the native kernel, where the CPU has it)
    and batches (torch._int_mm on their transpose view) give torch's w8a8 result to the bit."""
    w, _ = data
    layer = _layer(W8A8LinearMethod(), w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.qweight.shape == (N, KDIM) and layer.qweight.dtype == torch.int8
    # codes, fp32 scales, and (native) the codes' int32 row sums: no second copy of the codes
    assert runtime_bytes(layer) == N * KDIM + 4 * N + (4 * N if layer.native else 0)
    x = torch.randn(native.SMALL_M + 4, KDIM, generator=torch.Generator().manual_seed(1))
    for rows in (1, native.SMALL_M, native.SMALL_M + 4):
        ref = K.int8_dynamic_linear(x[:rows], layer.qweight.t().contiguous(), layer.wscale) + layer.bias
        assert torch.equal(layer(x[:rows]), ref)


@pytest.mark.parametrize("vnni", [True, False])
def test_int8_matmul_is_exact_on_either_path(monkeypatch, vnni: bool) -> None:
    """int8 x int8 -> int32 through torch._int_mm or float32 GEMMs over slices of at most 1024
    inputs: the same integers as an int64 product, at the largest magnitudes (every product 127 *
    127, and -127 * 127, so a slice sums to 1024 * 16129 < 2^24) and on random codes, K across
    the slice boundary."""
    monkeypatch.setattr(K, "int_mm_runs_vnni", lambda: vnni)
    g = torch.Generator().manual_seed(3)
    for k in (3, 1024, 1025, 2500):
        x = torch.randint(-127, 128, (17, k), generator=g, dtype=torch.int8)
        w = torch.randint(-127, 128, (k, 24), generator=g, dtype=torch.int8)
        x[0], w[:, 0], w[:, 1] = 127, 127, -127
        y = K.int8_matmul(x, w)
        assert y.dtype == torch.int32 and torch.equal(y.long(), x.long() @ w.long())


def test_fp8_within_e4m3_rounding(data) -> None:
    w, x = data
    layer = _layer(Fp8LinearMethod(), w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.qweight.dtype == torch.float8_e4m3fn
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 (values are scaled to the normal range
    # per channel; the smallest may be subnormal, with absolute error <= scale * 2^-10)
    scale = (w.abs().amax(dim=1) / K.FP8_MAX)[:, None]
    per_weight = w.abs() * 2.0**-4 + scale * 2.0**-10
    bound = x.abs() @ per_weight.T + EPS
    assert (layer(x) - _ref(layer, x, w)).abs().le(bound).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_equals_its_dequantized_weight(data, group: int) -> None:
    w, x = data
    codes, scales, zeros = K.quantize_groupwise(w, group, 4)
    deq = K.dequantize_groupwise(codes, scales, zeros)
    step = scales.repeat_interleave(group, dim=1)
    assert (deq - w).abs().le(step / 2 + 1e-6).all()  # round to nearest of 16 levels over [min, max]
    layer = _layer(Int4LinearMethod(group), w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.group_size == group and layer.kernel == "int4"
    err = (layer(x) - _ref(layer, x, deq)).abs()
    assert err.le(_bf16_bound(x, codes, scales, zeros)).all()


def _bf16_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                center: int = 8) -> torch.Tensor:
    """The 4/8-bit kernels take bfloat16 activations, scales and zeros (8-bit mantissas, relative
    rounding <= 2^-9 each), with the codes centred on `center` (torch's int4 kernel: 8, GGUF's
    8-bit codes: 128) or not (the native kernel's 4-bit codes): per weight |dw| <= 2^-9
    (|code - c| s + |zero + c s|), per input |dx| <= 2^-9 |x|; the sum of both over K, doubled for
    the cross terms and accumulation. Both centrings are bounded (the larger is taken). Where the
    native kernel quantizes the activations to int8, their rounding meets the centred weights
    (test_quant_native._int8_act_bound)."""
    g = codes.shape[1] // scales.shape[1]
    s = scales.repeat_interleave(g, 1)
    mag = torch.zeros_like(s)
    for c in (0, center):
        zp = (zeros + c * scales).repeat_interleave(g, 1)
        mag = torch.maximum(mag, (codes.float() - c).abs() * s + zp.abs())
    bound = 2.0**-8 * (x.abs() @ mag.T) + EPS
    if native.load_quant_kernel() is not None:
        bound = bound + _int8_act_bound(x, (codes.float() - center).abs() * s * (1 + 2.0**-8), x.shape[0])
    return bound


def test_int4_clip_search_never_worse(data) -> None:
    w, _ = data
    w = w.clone()
    w[:, ::50] *= 8  # outliers
    err = {}
    for clip in (False, True):
        codes, scales, zeros = K.quantize_groupwise(w, 32, 4, clip)
        err[clip] = ((K.dequantize_groupwise(codes, scales, zeros) - w) ** 2).reshape(N, -1, 32).sum(-1)
    assert (err[True] <= err[False] + 1e-9).all() and err[True].sum() < err[False].sum()


def test_int4_group_falls_back_to_a_divisor() -> None:
    layer = Linear(576, 64, dtype=torch.float32, quant_method=Int4LinearMethod(128))
    assert layer.quant_method.group_size == 64


# ---- GGUF blocks ------------------------------------------------------------------------------ #


@pytest.mark.parametrize("qtype", [2, 3, 6, 7, 8])
def test_gguf_codes_match_the_gguf_package(qtype: int) -> None:
    """Blocks made by gguf's own quantizer decode to exactly gguf's own dequantization."""
    x = np.random.default_rng(qtype).standard_normal((8, 256)).astype(np.float32)
    t = gguf.GGMLQuantizationType(qtype)
    raw = gguf.quants.quantize(x, t)
    ref = gguf.quants.dequantize(raw, t)
    gc = gguf_group_codes(raw.reshape(-1), qtype, (8, 256))
    assert int(gc.codes.max()) < 2 ** GGUF_TYPES[qtype][1]
    np.testing.assert_array_equal(gc.dequantize().numpy(), ref)


@pytest.mark.parametrize("qtype,block,d_at", [(12, 144, (0, 2)), (13, 176, (0, 2)), (14, 210, (208,))])
def test_gguf_k_quant_codes_match_the_gguf_package(qtype: int, block: int, d_at: tuple[int, ...]) -> None:
    """K-quant blocks (random bytes, sane fp16 scales) decode to gguf's dequantization."""
    rng = np.random.default_rng(qtype)
    raw = rng.integers(0, 256, (8, block), dtype=np.uint8)
    for p in d_at:
        raw[:, p : p + 2] = np.float16(rng.uniform(1e-3, 0.1, (8, 1))).view(np.uint8).reshape(8, 2)
    ref = gguf.quants.dequantize(raw.reshape(4, -1), gguf.GGMLQuantizationType(qtype))
    gc = gguf_group_codes(raw.reshape(-1), qtype, (4, 512))
    np.testing.assert_array_equal(gc.dequantize().numpy(), ref)


@pytest.mark.parametrize("qtype,kernel", [(3, "int4"), (8, "int8_group"), (14, "int8_group")])
def test_gguf_layer_computes_with_the_stored_blocks(qtype: int, kernel: str) -> None:
    x_w = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    t = gguf.GGMLQuantizationType(qtype)
    if qtype == 14:
        raw = np.random.default_rng(2).integers(0, 256, (64, 210), dtype=np.uint8)
        raw[:, 208:210] = np.float16(0.01)[None].view(np.uint8)[None].repeat(64, 0).reshape(64, 2)
        raw = raw.reshape(64, -1)[:, :]  # 64 blocks of 256 -> [64, 256] weight
        shape = (64, 256)
    else:
        raw, shape = gguf.quants.quantize(x_w, t), (64, 256)
    gc = gguf_group_codes(np.asarray(raw).reshape(-1), qtype, shape)
    _, bits, group = GGUF_TYPES[qtype]
    layer = Linear(256, 64, dtype=torch.float32, quant_method=GroupCodesLinearMethod("gguf", bits, group))
    layer.codes.data.copy_(gc.codes)
    layer.scales.data.copy_(gc.scales)
    layer.zeros.data.copy_(gc.zeros)
    layer.quant_method.process_weights_after_loading(layer)
    if qtype == 14 and native.load_quant_kernel() is not None:  # groups of 16: expanded once to the dtype
        kernel = "dense"
    assert layer.kernel == kernel and "codes" not in layer._parameters
    x = torch.randn(5, 256)
    err = (layer(x) - x @ gc.dequantize().T).abs()
    if kernel == "int4":
        assert err.le(_bf16_bound(x, gc.codes, gc.scales, gc.zeros)).all()
    elif layer.native:  # 8-bit codes in the native kernel: bfloat16 activations, scales and zeros
        assert err.le(_bf16_bound(x, gc.codes, gc.scales, gc.zeros, center=128)).all()
    else:
        assert err.max() < 1e-3


# ---- AWQ and GPTQ, packed by auto-round ------------------------------------------------------- #


def _rtn(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit round-to-nearest: scales, integer zero points [N, G], and the weight they give."""
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = (hi - lo).clamp(min=1e-6) / 15
    zp = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zp[..., None]).clamp(0, 15)
    scale16 = scale.half().float()
    deq = ((q - zp[..., None]) * scale16[..., None]).reshape(w.shape)
    return scale, zp, deq


def test_awq_unpacks_what_autoround_packs(data) -> None:
    awq = pytest.importorskip("auto_round.export.export_to_awq.utils")
    w, x = data
    linear = torch.nn.Linear(KDIM, N, bias=False)
    scale, zp, _ = _rtn(w, 32)
    linear.weight.data.copy_(w)
    packed = awq.WQLinear_GEMM.from_linear(linear, 4, 32, scales=scale.half().t().contiguous(),
                                           zeros=zp.t().contiguous(), device="cpu")
    gc = awq_group_codes("m", packed.qweight, packed.qzeros, packed.scales, 32)
    # reference: the definition w = (round(w/s + z) - z) * s, with auto-round's fp16 scales
    s16 = packed.scales.float().t().repeat_interleave(32, 1)
    zr = zp.repeat_interleave(32, 1)
    ref = (torch.round(w / s16 + zr).clamp(0, 15) - zr) * s16
    torch.testing.assert_close(gc.dequantize(), ref, atol=0, rtol=0)


def _gptq_pack(w: torch.Tensor, group: int):
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data.copy_(w)
    scale, zp, _ = _rtn(w, group)
    zp = zp.clamp(min=1)  # the v1 format stores zero - 1 and cannot hold 0
    q = QuantLinear(4, group, w.shape[1], w.shape[0], False, g_idx=True)
    q.pack(linear, scale.half().float(), zp, None, "cpu")
    s16 = q.scales.float().t().repeat_interleave(group, 1)
    zr = zp.repeat_interleave(group, 1)
    ref = (torch.round(w / s16 + zr).clamp(0, 15) - zr) * s16
    return q, ref


def test_gptq_unpacks_what_autoround_packs(data) -> None:
    pytest.importorskip("auto_round_extension.torch.qlinear_torch_zp")
    w, _ = data
    q, ref = _gptq_pack(w, 64)
    gc = gptq_group_codes("m", q.qweight, q.qzeros, q.scales, q.g_idx, 64, zero_offset=1)
    assert gc.perm is None
    torch.testing.assert_close(gc.dequantize(), ref, atol=0, rtol=0)


def test_gptq_act_order_follows_g_idx(data) -> None:
    """act-order: input k uses group g_idx[k]; the layer reorders its inputs to keep groups contiguous."""
    pytest.importorskip("auto_round_extension.torch.qlinear_torch_zp")
    w, x = data
    q, ref_contiguous = _gptq_pack(w, 64)
    perm = torch.randperm(KDIM, generator=torch.Generator().manual_seed(3))
    # the same codes, read as an act-order checkpoint: input k now belongs to group g_idx[k]
    g_idx = torch.empty(KDIM, dtype=torch.int32)
    g_idx[perm] = torch.arange(KDIM, dtype=torch.int32) // 64
    gc = gptq_group_codes("m", q.qweight, q.qzeros, q.scales, g_idx, 64, zero_offset=1)
    codes = (torch.stack([(q.qweight >> (4 * i)) & 15 for i in range(8)], 1).reshape(KDIM, N)).float()
    zeros = (torch.stack([(q.qzeros >> (4 * i)) & 15 for i in range(8)], -1).reshape(-1, N) + 1).float()
    scales = q.scales.float()
    hand = (codes - zeros[g_idx.long()]) * scales[g_idx.long()]  # [K, N], the format's definition
    torch.testing.assert_close(gc.dequantize(), hand.T, atol=0, rtol=0)
    layer = Linear(KDIM, N, dtype=torch.float32, quant_method=GroupCodesLinearMethod("gptq", 4, 64, act_order=True))
    for name in ("codes", "scales", "zeros", "perm"):
        getattr(layer, name).weight_loader(getattr(layer, name), getattr(gc, name))
    layer.quant_method.process_weights_after_loading(layer)
    err = (layer(x) - x @ hand).abs()
    assert err.le(_bf16_bound(x[:, gc.perm], gc.codes, gc.scales, gc.zeros)).all()


def test_malformed_gptq_names_the_tensor() -> None:
    qweight = torch.zeros(32, 96, dtype=torch.int32)
    with pytest.raises(QuantFormatError, match=r"'layers.0.mlp.up_proj.scales'.*shape \(3, 96\), expected \(4, 96\)"):
        gptq_group_codes("layers.0.mlp.up_proj", qweight, torch.zeros(4, 12, dtype=torch.int32),
                         torch.zeros(3, 96), None, 64)
    with pytest.raises(QuantFormatError, match=r"'layers.0.mlp.up_proj.qweight'.*group size 100"):
        gptq_group_codes("layers.0.mlp.up_proj", qweight, torch.zeros(4, 12, dtype=torch.int32),
                         torch.zeros(3, 96), None, 100)


def test_row_parallel_share_of_codes_scales_and_per_row_scales() -> None:
    """Rank 1 of 2 of a row-parallel layer (64 inputs, 32 each): its half of the codes' columns and
    of the per-group scales; a scale per row covers both halves, so each rank keeps it whole."""
    from pagedllm.distributed.parallel_state import TensorParallelGroup
    from pagedllm.layers.linear import RowParallelLinear
    from pagedllm.quantization.methods import GroupCodesLinearMethod

    tp = TensorParallelGroup()
    tp.rank, tp.size = 1, 2
    groups = RowParallelLinear(64, 4, tp=tp, quant_method=GroupCodesLinearMethod("t", 4, 16))
    codes, scales = torch.arange(4 * 64).reshape(4, 64), torch.arange(4 * 4.0).reshape(4, 4)
    assert torch.equal(groups.shard_checkpoint(groups.codes, codes, None), codes[:, 32:])
    assert torch.equal(groups.shard_checkpoint(groups.scales, scales, None), scales[:, 2:])
    per_row = RowParallelLinear(64, 4, tp=tp, quant_method=GroupCodesLinearMethod("t", 4, 32))
    row_scales = torch.arange(4.0).reshape(4, 1)
    assert torch.equal(per_row.shard_checkpoint(per_row.scales, row_scales, None), row_scales)
    with pytest.raises(ValueError, match="3 columns do not split into 2"):
        groups.shard_checkpoint(groups.scales, scales[:, :3], None)
