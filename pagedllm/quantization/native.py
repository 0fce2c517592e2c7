"""Native linear layers on 4-bit, 8-bit and fp8 (e4m3) group-wise codes (csrc/linear_quant.c),
where the CPU has AVX-512 BF16.

The weight is kept once, in the kernel's layout: 4-bit codes as 16 bytes per 32 inputs of a row
(ggml's Q4_0 nibble order), 8-bit codes as signed bytes, e4m3 as its bytes, and bfloat16 scales
and zeros per group (``w = code * scale + zero``). A few rows of x (decode steps) go through the kernel, one pass over
the codes; larger batches expand the weight in the kernel once per call for
``F.linear`` (oneDNN; float32 activations get a float32 weight), or use torch's int8 kernel on the same codes (per-channel int8).
Measured against torch's kernels in benchmarks/bench_quant_kernels.py (docs/quantization.md).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.attention.cpu_kernel import load_native

_SRC = Path(__file__).parent / "csrc" / "linear_quant.c"
QUANT_SRC = _SRC  # included by the fused decode step (pagedllm/worker/csrc/llama_decode.c)
# Most rows of x that go through the kernel (a decode batch); larger ones take the batch path.
SMALL_M = 16


@lru_cache(maxsize=1)
def load_quant_kernel() -> ctypes.CDLL | None:
    """The compiled kernel where the CPU has AVX-512 BF16 (else None: torch's kernels serve);
    ``PAGEDLLM_NATIVE_QUANT=0`` turns it off."""
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    linear = ([p, i64, p, p, p, i64, i64, i64, p, i32], i32)
    return load_native(_SRC, "PAGEDLLM_NATIVE_QUANT", {
        "int4_linear_bf16": linear, "int8_linear_bf16": linear, "e4m3_linear_bf16": linear,
        "quant_dequant": ([i32, p, p, p, i64, i64, i64, p, i32], i32),
    })


def fits(in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a layer of this input size and group size (and runs here)."""
    return group_size % 32 == 0 and in_features % group_size == 0 and load_quant_kernel() is not None


def pack_int4_native(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (0..15) -> [N, K/2] uint8 with, per 32 inputs, byte j = code j | code j+16 << 4;
    scales [N, K/g] in bfloat16, and the zeros of the centred codes (the kernel reads code - 8),
    zero + 8 scale, in bfloat16: near the group's middle, so their rounding is small."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    centred = zeros.float() + 8.0 * scales.float()
    return packed, scales.to(torch.bfloat16).contiguous(), centred.to(torch.bfloat16).contiguous()


def _in_features(codes: torch.Tensor, bits: int) -> int:
    return codes.shape[1] * (2 if bits == 4 else 1)


def small_m_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
                   ) -> torch.Tensor | None:
    """x [..., K] @ W^T through the kernel when x has at most SMALL_M rows (else None). ``codes``:
    :func:`pack_int4_native`'s layout (bits 4), int8 [N, K] (bits 8) or e4m3 bytes [N, K] viewed as
    uint8 (bits 3); ``scales``/``zeros`` bf16 [N, K/g]. x enters in bfloat16; the result returns in x's dtype (float32 or bfloat16)."""
    k = _in_features(codes, bits)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > SMALL_M:
        return None
    lib = load_quant_kernel()
    x2 = x2.to(torch.bfloat16).contiguous()
    n = codes.shape[0]
    out_f32 = x.dtype == torch.float32
    y = torch.empty(m, n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    f = {4: lib.int4_linear_bf16, 8: lib.int8_linear_bf16, 3: lib.e4m3_linear_bf16}[bits]
    if f(x2.data_ptr(), m, codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k, k // scales.shape[1],
         y.data_ptr(), int(out_f32)) != 0:
        raise ValueError(f"quantized kernel: group size {k // scales.shape[1]} does not fit {k} inputs")
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [N, K] in `dtype` (bfloat16 or float32), expanded from the kernel's layout."""
    k = _in_features(codes, bits)
    n = codes.shape[0]
    w = torch.empty(n, k, dtype=dtype)
    if load_quant_kernel().quant_dequant(bits, codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k,
                                         k // scales.shape[1], w.data_ptr(), int(dtype == torch.float32)) != 0:
        raise ValueError(f"quantized kernel: group size {k // scales.shape[1]} does not fit {k} inputs")
    return w


def group_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
                 ) -> torch.Tensor:
    """x @ W^T for any number of rows: the kernel for a few; for more, the weight expanded to x's
    dtype (float32 stays float32) and ``F.linear``."""
    y = small_m_linear(x, codes, scales, zeros, bits)
    if y is not None:
        return y
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    return F.linear(x.to(dtype), dequantize(codes, scales, zeros, bits, dtype)).to(x.dtype)
