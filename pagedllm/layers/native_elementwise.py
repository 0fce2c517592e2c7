"""Fused RMSNorm (with the residual add before it), SiLU·mul and rotary embedding on the CPU
(pagedllm/native/csrc/elementwise_bf16.c), in bfloat16 and float32: one pass over the rows instead
of the 2-7 torch ops (each a full pass and an allocation) of the reference formulas; bf16 with the
same rounding points, float32 with each product and sum rounded as torch rounds it (see the C file).

Each function returns None when the kernel does not apply (neither bf16 nor float32, not on the
CPU, a row size that is not a multiple of 16, no compiler, bf16 without AVX-512, float32 without
AVX-512 or AVX2 + FMA); the caller then runs the torch formula. Where the CPU has AVX2 + FMA but no
AVX-512 the float32 ops run in 8-lane forms with the same rounding points; with neither, the file
still gives the fused decode step its float32 row functions, as plain loops, and exports nothing.
The function names keep their bf16 origin; they serve both dtypes.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pagedllm import native
from pagedllm.native import kernels
from pagedllm.native.declare import Binding


@lru_cache(maxsize=1)
def load_elementwise_kernel() -> Binding | None:
    """The compiled kernel where the CPU has AVX-512, or AVX2 + FMA (float32 functions only; the
    bf16 ones need AVX-512); else None and torch runs the ops."""
    return native.load(kernels.ELEMENTWISE)


@lru_cache(maxsize=None)
def _function(op: str, dtype: torch.dtype):
    """The kernel's entry point of `op` for `dtype` (bf16 or float32), or None where it has none;
    looked up once per pair, not per call."""
    lib = load_elementwise_kernel()
    name = f"{op}_bf16" if dtype == torch.bfloat16 else f"{op}_f32"
    return getattr(lib, name, None) if lib is not None else None


_FLOATS = (torch.bfloat16, torch.float32)


def _rows_ok(x: torch.Tensor, n: int) -> bool:
    return (x.dtype in _FLOATS and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
            and n % 16 == 0 and not x.requires_grad)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h, y): h = x + add (x itself without `add`), y = RMSNorm(h) * weight, in x's dtype (bf16 or
    float32); or None."""
    T, N = x.shape if x.dim() == 2 else (0, 0)
    if (not _rows_ok(x, N) or weight.dtype != x.dtype or not weight.is_contiguous()
            or (add is not None and (add.shape != x.shape or add.dtype != x.dtype or not add.is_contiguous()))):
        return None
    fn = _function("rms_norm", x.dtype)
    if fn is None:
        return None
    y = torch.empty(T, N, dtype=x.dtype)
    h = x if add is None else torch.empty(T, N, dtype=x.dtype)
    rc = fn(
        x.data_ptr(),  # x
        x.stride(0),  # ldx
        0 if add is None else add.data_ptr(),  # add
        0 if add is None else h.data_ptr(),  # h_out
        weight.data_ptr(),  # w
        T,  # T
        N,  # N
        eps,  # eps
        y.data_ptr(),  # y
    )
    return None if rc else (h, y)


def silu_mul_bf16(x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for x = [gate | up] rows, in x's dtype (bf16 or float32); or None."""
    if x.dim() != 2 or x.shape[1] % 2:
        return None
    T, inter = x.shape[0], x.shape[1] // 2
    if not _rows_ok(x, inter):
        return None
    fn = _function("silu_mul", x.dtype)
    if fn is None:
        return None
    y = torch.empty(T, inter, dtype=x.dtype)
    return None if fn(x.data_ptr(), x.stride(0), T, inter, y.data_ptr()) else y


def rope_bf16(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              head_dim: int) -> torch.Tensor | None:
    """Rotate-half RoPE of x [T, heads * head_dim] (rows may be strided) at `positions` [T] (int64),
    with tables cos, sin [max_position, head_dim] of x's dtype (bf16 or float32), in that dtype; or
    None (also for a position outside the tables: the torch path then raises)."""
    if x.dim() != 2 or not _rows_ok(x, head_dim // 2) or head_dim % 2:
        return None
    if (cos.dtype != x.dtype or sin.dtype != x.dtype or not cos.is_contiguous()
            or not sin.is_contiguous() or positions.dtype != torch.int64 or not positions.is_contiguous()
            or positions.shape != (x.shape[0],) or cos.shape != sin.shape or cos.shape[1] != head_dim):
        return None
    fn = _function("rope", x.dtype)
    if fn is None:
        return None
    T, W = x.shape
    y = torch.empty(T, W, dtype=x.dtype)
    rc = fn(
        x.data_ptr(),  # x
        x.stride(0),  # ldx
        T,  # T
        W,  # W
        head_dim,  # hd
        positions.data_ptr(),  # pos
        cos.data_ptr(),  # cos
        sin.data_ptr(),  # sin
        cos.shape[0],  # max_pos
        y.data_ptr(),  # y
    )
    return None if rc else y
