"""Matrix products on quantized weights, and the quantizers that produce them (torch CPU ops).

Kernels were chosen by measurement (docs/quantization.md): torch's ``_weight_int8pack_mm`` for
int8 weights with float activations, ``_weight_int4pack_mm_for_cpu`` for 4-bit group-wise
weights, ``torch._int_mm`` (oneDNN, VNNI dot products) for int8 x int8 where the CPU has VNNI
(else exact float32 GEMMs, :func:`int8_matmul`). Weights of 5 to 8 bits
with group-wise scales (GGUF Q5/Q6/Q8) are kept as int8 codes and expanded one layer at a time
inside the product.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from pagedllm.hardware import cpu_flags

INT4_GROUP_SIZES = (32, 64, 128, 256)


# ---- int8, per output channel --------------------------------------------------------------- #


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and float32 scales [N] with w ~= codes * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def int8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (codes * scales)^T with int8 codes [N, K] and bfloat16 scales [N].

    Activations enter the kernel in bfloat16 (torch's float32 path of this kernel is 6-18x
    slower than the float matmul on this CPU, its bfloat16 path 3-10x faster; docs/quantization.md).
    """
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    return torch._weight_int8pack_mm(x2, codes, scales).to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_dequant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The unfused int8 path (a reference for benchmarks): the weight widened to x's dtype and
    scaled on every call, then ``F.linear``."""
    return F.linear(x, codes.to(x.dtype) * scales.to(x.dtype)[:, None])


# Inputs per float32 product of int8 values that is exact: every partial sum is an integer of at
# most 1024 * 127 * 127 < 2^24 in magnitude, so no order of the additions rounds.
EXACT_F32_K = 1024


@lru_cache(maxsize=1)
def int_mm_runs_vnni() -> bool:
    """Whether torch._int_mm has VNNI dot products here (AVX-512 VNNI or AVX-VNNI). Without them its
    int8 GEMM is oneDNN's slow path: 277 ms for 256 x 576 x 3072 on a 2-core AVX2 CPU, against 18.5
    ms for widening both operands to float32 and one float32 GEMM."""
    flags = cpu_flags()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def int8_matmul(xq: torch.Tensor, codes_t: torch.Tensor) -> torch.Tensor:
    """xq [M, K] int8 @ codes_t [K, N] int8 -> int32 [M, N], exact: ``torch._int_mm`` where it runs
    VNNI, else float32 GEMMs over K in slices of at most EXACT_F32_K inputs (each exact, summed in
    int32), the same integers."""
    if int_mm_runs_vnni():
        return torch._int_mm(xq, codes_t)
    k = xq.shape[1]
    acc: torch.Tensor | None = None
    for k0 in range(0, k, EXACT_F32_K):
        part = torch.mm(xq[:, k0:k0 + EXACT_F32_K].float(), codes_t[k0:k0 + EXACT_F32_K].float()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc if acc is not None else torch.zeros(xq.shape[0], codes_t.shape[1], dtype=torch.int32)


def int8_dynamic_linear(x: torch.Tensor, codes_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W8A8: each token's activations quantized to int8 (its own scale), int8 x int8 -> int32.

    ``codes_t`` is the transposed weight [K, N] (int8; the transpose view of [N, K] codes runs as
    fast), ``scales`` float32 [N]. The native kernel's decode rows (native.w8a8_small_m_linear)
    follow this function's formula and rounding step by step.
    """
    x2 = x.reshape(-1, x.shape[-1]).float()
    x_scale = (x2.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    xq = torch.round(x2 / x_scale).clamp(-127, 127).to(torch.int8)
    acc = int8_matmul(xq, codes_t)
    y = acc.float().mul_(x_scale).mul_(scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


# ---- fp8 e4m3, per output channel ------------------------------------------------------------ #

FP8_MAX = 448.0


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights [N, K] and float32 scales [N] with w ~= fp8 * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def fp8_weight_linear(x: torch.Tensor, w8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (fp8 * scales)^T: the e4m3 weight is widened to x's dtype, the scale applied after."""
    return F.linear(x, w8.to(x.dtype)) * scales


# ---- group-wise affine codes (int4, GGUF, AWQ, GPTQ) ----------------------------------------- #


def quantize_groupwise(
    w: torch.Tensor, group_size: int, bits: int = 4, clip_search: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes [N, K] (uint8, 0..2^bits-1), scales and zeros [N, K/g] (float32).

    ``w ~= codes * scale + zero`` per group. With ``clip_search`` each group's range is shrunk
    by the factor (1.0, 0.95, ... 0.75) that gives the smallest squared error of that group.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    qmax = (1 << bits) - 1
    lo0, hi0 = g.amin(dim=-1), g.amax(dim=-1)
    best = None
    for ratio in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75) if clip_search else (1.0,):
        lo, hi = lo0 * ratio, hi0 * ratio
        scale = ((hi - lo) / qmax).clamp(min=1e-10)
        codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, qmax)
        err = ((codes * scale[..., None] + lo[..., None] - g) ** 2).sum(-1)
        if best is None:
            best = (err, codes, scale, lo)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better[..., None], codes, best[1]),
                torch.where(better, scale, best[2]), torch.where(better, lo, best[3]))
    _, codes, scale, lo = best  # type: ignore[misc]
    return codes.reshape(n, k).to(torch.uint8), scale, lo


def dequantize_groupwise(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from codes [N, K] and per-group scales/zeros [N, K/g]."""
    n, k = codes.shape
    groups = scales.shape[1]
    w = codes.reshape(n, groups, k // groups).float() * scales[..., None] + zeros[..., None]
    return w.reshape(n, k)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout of ``_weight_int4pack_mm_for_cpu``: packed codes and [K/g, N, 2] scale/zero pairs.

    The kernel computes ``(code - 8) * scale + zero'``; with ``w = code * scale + zero`` that is
    ``zero' = zero + 8 * scale``. Scales are kept in bfloat16: the kernel's float32 path is about
    100x slower than its bfloat16 one on this CPU (docs/quantization.md).
    """
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scales, zeros + 8.0 * scales], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, sz


def int4_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] @ W^T for W packed by :func:`pack_int4`; activations enter the kernel in the
    scales' dtype (bfloat16) and the result returns in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).to(sz.dtype).contiguous()
    y = torch._weight_int4pack_mm_for_cpu(x2, packed, group_size, sz)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_group_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                      ) -> torch.Tensor:
    """x @ W^T for int8 codes [N, K] with per-group scales/zeros in x's dtype (W widened per call)."""
    n, k = codes.shape
    groups = scales.shape[1]
    w = torch.addcmul(zeros[..., None], codes.reshape(n, groups, k // groups).to(x.dtype), scales[..., None])
    return F.linear(x, w.reshape(n, k))
