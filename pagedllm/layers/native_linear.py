"""GEMMs of a few rows (decode steps, short prompt chunks) in float32 and bfloat16
(pagedllm/native/csrc/small_m_gemm.c).

A decode GEMM should be a single pass over the weights. torch's bf16 `F.linear` with one row runs
slower than fp32 on AVX-512 (oneDNN's small-M path), and its float32 one (MKL) reads the weights at
about half the rate this kernel does; this kernel is that one pass, with fp32 accumulation (bf16
through AVX-512 BF16 dot products, or widened to float32 in registers on AVX2 CPUs, where torch's
bf16 GEMMs are emulated). Larger M keeps torch's GEMMs (layers/linear.py).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pagedllm import native
from pagedllm.hardware import cpu_flags
from pagedllm.native import kernels
from pagedllm.native.declare import Binding

# Most rows of x sent to the kernel, per dtype: up to where it stops beating torch's GEMM on the
# default model's shapes with the weights streamed from memory (pagedllm bench kernels small-m-gemm,
# 2-core AVX-512 machine, the four GEMMs of 30 layers): bf16 16 rows 7.3 ms against oneDNN's 13.5,
# 32 rows 11.4 against 17.7, 48 rows 15.9 against 23.9, 64 rows 21.9-25.9 against 26.2-28.9, 80
# rows 1.10-1.19x, 96 rows 0.97-1.03x. float32: oneDNN takes over from 16 rows (layers/linear.py);
# below that torch's GEMM is MKL's sgemm, 2.4-2.7x slower (8 rows 12.8 against 35.1 ms), and the
# kernel stops beating oneDNN from 24 rows (0.94-0.96x). That float32 limit is the AVX-512 form's;
# the AVX2 + FMA form (2-core Zen 1 host, same benchmark) beats oneDNN's AVX2 GEMM up to 128 rows
# (16 rows 63 against 109 ms, 32 rows 113 against 164, 64 rows 234 against 307, 128 rows 437
# against 490) and falls behind from 192 (654 against 628 ms), so on such CPUs it takes prompt
# chunks and decode batches up to 128 rows.
F32_ROWS_AVX512, F32_ROWS_AVX2 = 15, 128
# bf16 on AVX2 + FMA (the widening form): x widened once per GEMM, each W block once into a float32
# panel, so the kernel runs at its float32 rate while reading half the bytes. Against bf16 widened
# to float32 ahead of oneDNN's float32 GEMM (what layers/linear.py does past this limit), 30 layers,
# 2-core Zen 1 host: 1 row 12.4 against 56.0 ms, 16 rows 60.6 against 149, 64 rows 216 against
# 307, 128 rows 413 against 487, 192 rows 630 against 679, 256 rows 898 against 893, 512 rows 1,728
# against 1,627.
BF16_ROWS_AVX512, BF16_ROWS_AVX2 = 64, 256
# bf16 with AMX (Sapphire Rapids and later Xeons): from small_m_amx_rows() rows (2) the kernel
# multiplies on AMX tiles, reading each W row once as the tiles' first operand. Against oneDNN's
# AMX GEMM, same benchmark, 2-core Xeon with AMX-BF16: 1 row (AVX-512 BF16 form) 8.1 against 17.2
# ms, 8 rows 9.3 against 17.6, 16 rows 9.7 against 17.9, 32 rows 13.1 against 19.2, 64 rows 19.2
# against 27.8, 128 rows 29.4 against 28.8, 256 rows 49.3 against 42.5. Since its sums go to y
# through a register transpose and x is packed the same way (1ee0889; two alternating runs on a
# host whose speed halved and doubled within minutes, so only the ratios in each run compare):
# 32 rows 1.55-1.56x, 64 rows 1.36-1.41x, 128 rows 1.18-1.19x (0.68-0.91x before), 256 rows
# 0.96-1.07x, 512 rows 0.93x. It takes up to 128 rows.
BF16_ROWS_AMX = 128
# float16 on AVX2 + FMA + F16C: the bf16 form's loop on F16C-widened values, same limit. On AVX-512
# (gemm_tile_f16: W widened by vcvtph2ps, float32 FMAs) up to F16_ROWS_AVX512 rows.
F16_ROWS_AVX2 = BF16_ROWS_AVX2
F16_ROWS_AVX512 = 64
AVX512_FORM = frozenset({"avx512f", "avx512bw"}) <= cpu_flags()  # HAVE_AVX512 in small_m_gemm.c
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_K_STEP = {torch.float32: 16, torch.bfloat16: 32, torch.float16: 32}


@lru_cache(maxsize=1)
def load_linear_kernel() -> Binding | None:
    """The compiled kernel where the CPU has AVX-512 or AVX2 + FMA (else None: torch serves every GEMM)."""
    lib = native.load(kernels.LINEAR)
    return lib if lib is not None and lib.small_m_available() else None


@lru_cache(maxsize=None)
def kernel_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this CPU's kernel serves: float32 with AVX-512 or AVX2 + FMA, bfloat16 with AVX-512
    BF16 or AVX2 + FMA, float16 with AVX-512 or AVX2 + FMA, and F16C."""
    lib = load_linear_kernel()
    bits = lib.small_m_available() if lib is not None else 0
    return frozenset(d for d, bit in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 8)) if bits & bit)


@lru_cache(maxsize=1)
def amx_rows() -> int:
    """The fewest rows of x from which the kernel's bf16 GEMMs run on AMX tiles by default (0: no
    AMX here; amx_rows_from changes it for a while)."""
    lib = load_linear_kernel()
    return lib.small_m_amx_rows() if lib is not None else 0


def _kernel_libs() -> list[Binding]:
    """Both libraries that hold the kernel, where they load: this module's and the fused decode
    step's (llama_decode.c includes the kernel), each with its own settings."""
    return [lib for lib in (load_linear_kernel(), native.load(kernels.DECODE)) if lib is not None]


# What both libraries that hold the kernel were last given by amx_rows_from (None: nothing yet).
_amx_from: int | None = None


def amx_rows_from(rows: int) -> None:
    """Where the CPU has AMX-BF16: bf16 GEMMs of `rows` rows of x or more run on the tiles from now
    on (0: from amx_rows(), the default), fewer in the AVX-512 BF16 form, in which each row gives
    the bits it gives alone (the two forms sum in different orders). A speculating engine raises it
    for a step of one request's last token and proposals, so that each of those rows gives the bits
    of the single row the request decodes without speculation. One setting per process, in this
    module's library and the fused decode step's (llama_decode.c includes the kernel); passed on
    only when it changes."""
    global _amx_from
    if _amx_from == rows or not amx_rows():  # amx_rows() first: its cache holds the default
        return
    for lib in _kernel_libs():
        lib.small_m_amx_from(rows)
    _amx_from = rows


def row1_reads(on: bool | None = None) -> bool:
    """Whether a single row of x reads W row after row (the AVX-512 form's one-row path) rather than
    in the tiles' 4-row blocks; `on` sets it from now on in both libraries that hold the kernel.
    By default on AMD CPUs with AVX-512, where it reads W faster, and off on Intel's
    (small_m_gemm.c); the same bits either way. False where the build has no such form."""
    arg = -1 if on is None else int(on)
    settings = [lib.small_m_row1(arg) for lib in _kernel_libs()]
    return bool(settings[0]) if settings else False


@lru_cache(maxsize=None)
def small_m_rows(dtype: torch.dtype) -> int:
    """The most rows of x the kernel takes in `dtype` (0: none), by the form the library was built in."""
    if dtype not in kernel_dtypes():
        return 0
    if dtype == torch.float32:
        return F32_ROWS_AVX512 if AVX512_FORM else F32_ROWS_AVX2
    if dtype == torch.float16:
        return F16_ROWS_AVX512 if load_linear_kernel().small_m_available() & 16 else F16_ROWS_AVX2
    if load_linear_kernel().small_m_available() & 4:
        return BF16_ROWS_AVX2
    return BF16_ROWS_AMX if amx_rows() else BF16_ROWS_AVX512


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + b through the kernel when it applies (float32, bf16 or float16 on the CPU, at most
    small_m_rows(dtype) rows, K a multiple of 16 / 32, contiguous weight), else None."""
    dt = x.dtype
    if (dt not in _DTYPE_CODES or weight.dtype != dt or x.dim() != 2 or x.shape[0] > small_m_rows(dt)
            or x.shape[1] % _K_STEP[dt] or x.device.type != "cpu" or not weight.is_contiguous()):
        return None
    lib = load_linear_kernel()
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=dt)
    b = None if bias is None else bias.contiguous().data_ptr()
    rc = lib.small_m_linear(
        x.data_ptr(),  # x
        M,  # M
        weight.data_ptr(),  # w
        b,  # bias
        N,  # N
        K,  # K
        y.data_ptr(),  # y
        _DTYPE_CODES[dt],  # dt
    )
    return None if rc else y
