"""bf16 GEMMs of a few rows (decode steps) on AVX-512 BF16 dot products (csrc/linear_bf16.c).

torch's bf16 `F.linear` with one row runs slower than fp32 here (oneDNN's small-M path), while a
decode GEMM should be a single pass over the weights at half fp32's bytes; this kernel is that
pass. Larger M keeps `F.linear` (oneDNN's bf16 GEMM is fast there).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

from pagedllm.attention.cpu_kernel import compile_native

_SRC = Path(__file__).parent / "csrc" / "linear_bf16.c"
# Most rows of x the kernel takes (its register blocking).
SMALL_M = 4


@lru_cache(maxsize=1)
def load_linear_kernel() -> ctypes.CDLL | None:
    """The compiled kernel where the CPU has AVX-512 BF16 (else None: torch serves every GEMM)."""
    if os.environ.get("PAGEDLLM_NATIVE_LINEAR", "1") == "0":
        return None
    lib = compile_native(_SRC)
    if lib is None or not hasattr(lib, "linear_bf16_small_m"):
        return None
    f = lib.linear_bf16_small_m
    i64, p = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [p, i64, p, i64, i64, p, p]
    f.restype = ctypes.c_int
    return lib


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + b through the kernel when it applies (bf16, <= SMALL_M contiguous rows, K % 32 == 0),
    else None."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] > SMALL_M
            or x.shape[1] % 32 or not weight.is_contiguous()):
        return None
    lib = load_linear_kernel()
    if lib is None:
        return None
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    b = 0 if bias is None else bias.contiguous().data_ptr()
    if lib.linear_bf16_small_m(x.data_ptr(), M, weight.data_ptr(), N, K, b, y.data_ptr()) != 0:
        return None
    return y
