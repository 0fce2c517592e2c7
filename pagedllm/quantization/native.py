"""Native linear layers on 4-bit, 8-bit and fp8 (e4m3) group-wise codes
(pagedllm/native/csrc/linear_quant.c), where the CPU has AVX-512 BF16, or AVX2 with FMA (the same
layouts and int32 sums in 8-lane vectors, vpmaddubsw for VNNI's dot products; see linear_quant.c).

The weight is kept once, in the kernel's layout: 4-bit and int8 codes tiled by 16 output rows
(:func:`pack_int4_native`, :func:`pack_int8_native`), e4m3 as its bytes, and bfloat16 scales and
zeros per group (``w = code * scale + zero``). A few rows of x (decode steps) go through the
kernel, one pass over the codes; larger batches expand the weight in the kernel once per call for
``F.linear`` (oneDNN; float32 activations get a float32 weight).

The activations of 4-bit and int8 codes go in as int8 per block of 32 inputs (VNNI dot products,
as llama.cpp's Q4_0 x Q8_0) or in bfloat16; ``PAGEDLLM_QUANT_ACTIVATIONS`` (``int8``, the default,
or ``bf16``) chooses, once per process, for the LinearMethods and the fused decode step alike.
Measured against torch's kernels in benchmarks/bench_quant_kernels.py (docs/quantization.md).
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch
import torch.nn.functional as F

from pagedllm import envs, native
from pagedllm.hardware import cpu_flags
from pagedllm.native import kernels
from pagedllm.native.declare import Binding
from pagedllm.quantization import kernels as K

# Most rows of x that go through the kernel (decode batches, short prompt chunks); larger ones take
# the batch path (the weight expanded for F.linear). Where the CPU has AVX-512 BF16: 16, above which
# oneDNN's bf16 GEMM on the expanded weight wins. The AVX2 forms of the 4-bit, int8 and w8a8 kernels
# beat the expansion plus a float32 GEMM at every size measured up to 256 rows (two threads,
# gate_up 3072 x 576 / down 576 x 1536: 4-bit 5.9x / 2.7x at 16 rows, 2.1x / 1.5x at 64, 1.9x /
# 1.1x at 128, 1.25x / 1.15x at 256; int8 tiles and w8a8 alike), so there they take up to 256; the
# e4m3 kernel (float FMAs) only to 16 (0.5x at 64).
AVX512_KERNELS = frozenset({"avx512_bf16", "avx512f", "avx512bw"}) <= cpu_flags()
SMALL_M = 16 if AVX512_KERNELS else 256
E4M3_ROWS = 16
# Output rows per tile of the 4-bit and int8 layouts (TR in linear_quant.c).
TILE = 16


@lru_cache(maxsize=1)
def int8_activations() -> bool:
    """Whether 4-bit and int8 codes meet int8 activations (``PAGEDLLM_QUANT_ACTIVATIONS``: ``int8``,
    the default, or ``bf16``); one choice per process, so the fused decode step and the
    LinearMethods run the same kernel."""
    return envs.PAGEDLLM_QUANT_ACTIVATIONS == "int8"


@lru_cache(maxsize=1)
def load_quant_kernel() -> Binding | None:
    """The compiled kernel where the CPU has AVX-512 BF16 or AVX2 + FMA (else None: torch's kernels serve);
    ``PAGEDLLM_NATIVE_QUANT=0`` turns it off."""
    return native.load(kernels.QUANT)


def fits(in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a layer of this input size and group size (and runs here)."""
    return group_size % 32 == 0 and in_features % group_size == 0 and load_quant_kernel() is not None


def _tile_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows appended up to a multiple of TILE."""
    pad = -t.shape[0] % TILE
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def _tile_groups(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros [N, K/g] -> the kernel's [N/16, K/g, 16] order (as [Np, K/g]), bfloat16."""
    def tile(t: torch.Tensor) -> torch.Tensor:
        t = _tile_rows(t.to(torch.bfloat16))
        n, groups = t.shape
        return t.reshape(n // TILE, TILE, groups).transpose(1, 2).reshape(n, groups).contiguous()

    return tile(scales), tile(zeros)


def pack_int4_native(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (0..15) -> the kernel's tiles, [Np, K/2] uint8 (Np: N rounded up to 16): per
    16 rows and 8 inputs, 64 bytes whose dword j holds row j's codes of inputs 0-3 in the low
    nibbles and 4-7 in the high ones; scales and the zeros of the centred codes (the kernel reads
    code - 8), zero + 8 scale, near the group's middle so their rounding is small, in bfloat16,
    tiled alike."""
    n, k = codes.shape
    c = _tile_rows(codes.to(torch.uint8)).reshape(-1, TILE, k // 8, 2, 4)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(1, 2).reshape(-1, k // 2).contiguous()
    s, z = _tile_groups(scales.float(), zeros.float() + 8.0 * scales.float())
    return packed, s, z


def pack_int8_native(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centred int8 codes [N, K] (w = code * scale + zero) -> the kernel's tiles, [Np, K] uint8
    holding code + 128: per 16 rows and 4 inputs, 64 bytes whose dword j holds row j's; scales and
    zeros [N, K/g] in bfloat16, tiled alike."""
    n, k = codes.shape
    u = (_tile_rows(codes.to(torch.int16)) + 128).to(torch.uint8).reshape(-1, TILE, k // 4, 4)
    s, z = _tile_groups(scales.float(), zeros.float())
    return u.transpose(1, 2).reshape(-1, k).contiguous(), s, z


def kernel_rows(bits: int) -> int:
    """Most rows of x the kernel takes for these codes (bits 4, 8; 3: e4m3; 9: w8a8, whose kernel
    takes any number where it has a batch form: w8a8_rows)."""
    return E4M3_ROWS if bits == 3 else w8a8_rows() if bits == 9 else SMALL_M


def _in_features(codes: torch.Tensor, bits: int) -> int:
    return codes.shape[1] * (2 if bits == 4 else 1)


def _group_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n: int, k: int
                  ) -> tuple[int, int, int, int, int, int]:
    """The weight's arguments of the group-wise kernels (linear, dequant, gather), in their order:
    codes, scales, zeros, N, K, G."""
    return codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k, k // scales.shape[1]


def _check_groups(rc: int, k: int, scales: torch.Tensor) -> None:
    """A group-wise kernel's return code: non-zero when the group size does not divide K."""
    if rc != 0:
        raise ValueError(f"quantized kernel: group size {k // scales.shape[1]} does not fit {k} inputs")


def small_m_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                   n: int) -> torch.Tensor | None:
    """x [..., K] @ W^T (W: n output rows) through the kernel when x has at most kernel_rows(bits)
    rows (else None). ``codes``: :func:`pack_int4_native`'s tiles (bits 4), :func:`pack_int8_native`'s (bits
    8) or e4m3 bytes [N, K] viewed as uint8 (bits 3); ``scales``/``zeros`` bf16 in the same layout.
    x enters in bfloat16 (then int8 per block of 32 where :func:`int8_activations`); the result
    returns in x's dtype (float32 or bfloat16)."""
    k = _in_features(codes, bits)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > kernel_rows(bits):
        return None
    lib = load_quant_kernel()
    x2 = x2.to(torch.bfloat16).contiguous()
    out_f32 = x.dtype == torch.float32
    y = torch.empty(m, n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    f = {4: lib.int4_linear_bf16, 8: lib.int8_linear_bf16, 3: lib.e4m3_linear_bf16}[bits]
    rc = f(
        x2.data_ptr(),  # x
        m,  # M
        *_group_weight(codes, scales, zeros, n, k),  # codes scales zeros N K G
        y.data_ptr(),  # y
        int(out_f32),  # y_f32
        int(int8_activations()),  # int8_act
    )
    _check_groups(rc, k, scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


@lru_cache(maxsize=1)
def w8a8_rows() -> int:
    """Most rows of x :func:`w8a8_small_m_linear` takes: every number where the kernel has a batch
    form, that is on AVX-512 builds: AMX tiles from 5 rows where the CPU has AMX-INT8
    (linear_quant_amx.h), else vpdpbusd over 16 x 16 blocks from 5 rows (linear_quant_vnni.h). On
    SmolLM2's layers both beat :func:`w8a8_batch_linear` (``torch._int_mm`` between the kernel's
    passes) from 5 rows, by 1.2-2.6x at 16-64 rows; from 128 rows they are within 10% of it on
    the 576-wide layers in some runs, faster on the others (docs/quantization.md, "w8a8 on AMX
    tiles" and "w8a8 batches in the vpdpbusd form"). Elsewhere (the AVX2 form) SMALL_M."""
    lib = load_quant_kernel()
    batch = lib is not None and (lib.w8a8_amx_rows() > 0 or lib.w8a8_vnni_rows() > 0)
    return sys.maxsize if batch else SMALL_M


def _w8a8_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x's rows [M, K] as the w8a8 kernels read them: float32 and bfloat16 as they are, float16 as
    float32 (exact), contiguous."""
    x2 = x.reshape(-1, k)
    return (x2 if x.dtype in (torch.float32, torch.bfloat16) else x2.float()).contiguous()


def w8a8_small_m_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, wsum: torch.Tensor
                        ) -> torch.Tensor | None:
    """w8a8's x [..., K] @ (codes * scales)^T through the kernel when x has at most :func:`w8a8_rows`
    rows (else None), equal to :func:`pagedllm.quantization.kernels.int8_dynamic_linear` to the bit: each row of x
    quantized to int8 with one scale (the same formula and rounding), exact int32 sums, then the
    same two fp32 products. ``codes`` int8 [N, K] row-major, ``scales`` float32 [N], ``wsum`` int32 [N]
    (the codes' row sums). float32 and bfloat16 x go in as they are; float16 as float32 (exact), the
    result rounded back, as the torch path does."""
    k = codes.shape[1]
    m = x.numel() // k
    if m > w8a8_rows():
        return None
    xk = _w8a8_rows(x, k)
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=xk.dtype)
    rc = load_quant_kernel().w8a8_linear(
        xk.data_ptr(),  # x
        m,  # M
        codes.data_ptr(),  # codes
        scales.data_ptr(),  # scales
        wsum.data_ptr(),  # wsum
        n,  # N
        k,  # K
        y.data_ptr(),  # y
        int(xk.dtype == torch.float32),  # f32
    )
    if rc != 0:
        raise ValueError(f"w8a8 kernel: {m} x {k} activations do not fit")
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def w8a8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, wsum: torch.Tensor) -> torch.Tensor:
    """w8a8's x [..., K] @ (codes * scales)^T as W8A8LinearMethod runs it: the kernel where it
    takes x's rows (:func:`w8a8_small_m_linear`: every number on AVX-512 builds), else the batch
    path (:func:`w8a8_batch_linear`). The same bits either way."""
    y = w8a8_small_m_linear(x, codes, scales, wsum)
    return y if y is not None else w8a8_batch_linear(x, codes, scales)


def w8a8_batch_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w8a8's x [..., K] @ (codes * scales)^T for any number of rows where the kernel has no batch
    form of its own (the AVX2 form, past :func:`w8a8_rows`), equal to
    :func:`pagedllm.quantization.kernels.int8_dynamic_linear` to the bit: the kernel quantizes the
    rows (the same formula and rounding as the decode rows' kernel), ``torch._int_mm`` (oneDNN's
    VNNI GEMM; without VNNI, exact float32 GEMMs: kernels.int8_matmul) sums them against the codes' transpose, and the kernel applies the two fp32 products
    (one pass each instead of the torch formula's dozen ops). Arguments as
    :func:`w8a8_small_m_linear`."""
    n, k = codes.shape
    m = x.numel() // k
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    xk = _w8a8_rows(x, k)
    f32 = int(xk.dtype == torch.float32)
    lib = load_quant_kernel()
    xq = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, dtype=torch.float32)
    if lib.w8a8_quantize_rows(xk.data_ptr(), m, k, f32, xq.data_ptr(), d.data_ptr()) != 0:
        raise MemoryError(f"w8a8 kernel: no scratch for a row of {k} activations")
    acc = K.int8_matmul(xq, codes.t())
    y = torch.empty(m, n, dtype=xk.dtype)
    lib.w8a8_scale_rows(acc.data_ptr(), m, n, d.data_ptr(), scales.data_ptr(), y.data_ptr(), f32)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, n: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [n, K] in `dtype` (bfloat16 or float32), expanded from the kernel's layout."""
    k = _in_features(codes, bits)
    w = torch.empty(n, k, dtype=dtype)
    rc = load_quant_kernel().quant_dequant(
        bits,  # bits
        *_group_weight(codes, scales, zeros, n, k),  # codes scales zeros N K G
        w.data_ptr(),  # w
        int(dtype == torch.float32),  # w_f32
    )
    _check_groups(rc, k, scales)
    return w


def gather_rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, n: int,
                ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``ids`` of the weight (an embedding lookup on codes), [*ids.shape, K] in ``dtype``: the
    values :func:`dequantize` gives for those rows, bit for bit, with only these rows expanded; ids
    outside [0, n) give zero rows. float16 comes from the float32 rows."""
    k = _in_features(codes, bits)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out_f32 = dtype != torch.bfloat16
    out = torch.empty(flat.numel(), k, dtype=torch.float32 if out_f32 else torch.bfloat16)
    rc = load_quant_kernel().quant_gather_rows(
        bits,  # bits
        *_group_weight(codes, scales, zeros, n, k),  # codes scales zeros N K G
        flat.data_ptr(),  # ids
        flat.numel(),  # M
        out.data_ptr(),  # out
        int(out_f32),  # out_f32
    )
    _check_groups(rc, k, scales)
    return out.to(dtype).reshape(*ids.shape, k)


def group_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 n: int) -> torch.Tensor:
    """x @ W^T (n output rows) for any number of rows: the kernel for a few; for more, the weight
    expanded to x's dtype (float32 stays float32) and ``F.linear``."""
    y = small_m_linear(x, codes, scales, zeros, bits, n)
    if y is not None:
        return y
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    return F.linear(x.to(dtype), dequantize(codes, scales, zeros, bits, n, dtype)).to(x.dtype)
