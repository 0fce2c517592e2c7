"""Native 4-bit group-wise linear layer (csrc/linear_int4.c), where the CPU has AVX-512 BF16.

The weight is kept once, in the kernel's layout: 16 bytes of codes per 32 inputs of a row
(ggml's Q4_0 nibble order) and bfloat16 scales and zeros per group (``w = code * scale + zero``).
A few rows of x (decode steps) go through the kernel, one pass over the codes; larger batches
expand the weight to bfloat16 in the kernel once per call and use ``F.linear`` (oneDNN).
Measured against torch's ``_weight_int4pack_mm_for_cpu`` in benchmarks/bench_quant_kernels.py.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.attention.cpu_kernel import compile_native

_SRC = Path(__file__).parent / "csrc" / "linear_int4.c"
# Most rows of x that go through the kernel; larger batches expand the weight for oneDNN.
SMALL_M = 16


@lru_cache(maxsize=1)
def load_int4_kernel() -> ctypes.CDLL | None:
    """The compiled kernel where the CPU has AVX-512 BF16 (else None: torch's int4 kernel serves)."""
    if os.environ.get("PAGEDLLM_NATIVE_INT4", "1") == "0":
        return None
    lib = compile_native(_SRC)
    if lib is None or not hasattr(lib, "int4_linear_bf16"):
        return None
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.int4_linear_bf16.argtypes = [p, i64, p, p, p, i64, i64, i64, p, ctypes.c_int]
    lib.int4_linear_bf16.restype = ctypes.c_int
    lib.int4_dequant_bf16.argtypes = [p, p, p, i64, i64, i64, p]
    lib.int4_dequant_bf16.restype = ctypes.c_int
    return lib


def pack_int4_native(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (0..15) -> [N, K/2] uint8 with, per 32 inputs, byte j = code j | code j+16 << 4;
    scales and zeros [N, K/g] in bfloat16."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, scales.to(torch.bfloat16).contiguous(), zeros.to(torch.bfloat16).contiguous()


def int4_native_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                       ) -> torch.Tensor:
    """x [..., K] @ W^T for W packed by :func:`pack_int4_native`; x enters in bfloat16, the result
    returns in x's dtype (float32 or bfloat16)."""
    lib = load_int4_kernel()
    if lib is None:
        raise RuntimeError("the native int4 kernel is not available on this CPU")
    n, k = packed.shape[0], packed.shape[1] * 2
    group = k // scales.shape[1]
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    m = x2.shape[0]
    if m > SMALL_M:
        w = torch.empty(n, k, dtype=torch.bfloat16)
        if lib.int4_dequant_bf16(packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k, group,
                                 w.data_ptr()) != 0:
            raise ValueError(f"int4 kernel: group size {group} does not fit {k} inputs")
        return F.linear(x2, w).to(x.dtype).reshape(*x.shape[:-1], n)
    out_f32 = x.dtype == torch.float32
    y = torch.empty(m, n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    if lib.int4_linear_bf16(x2.data_ptr(), m, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k, group,
                            y.data_ptr(), int(out_f32)) != 0:
        raise ValueError(f"int4 kernel: group size {group} does not fit {k} inputs")
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
