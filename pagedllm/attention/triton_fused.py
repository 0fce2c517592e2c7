"""Fused elementwise kernels for the GPU path: RMSNorm (optionally with the residual add folded
in) and rotary embedding of q and k in one pass.

Unfused, RMSNorm in 16-bit runs six kernels that each read and write the whole activation in
float32, and RoPE about ten over q and k; in a long prefill that traffic is a few percent of the
step. Here each token's row is read once and written once, with the arithmetic in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N_PAD)
    m = i < N
    x = tl.load(x_ptr + t * stride_x + i, mask=m, other=0.0)
    if ADD_RESIDUAL:
        # h = x + residual, rounded to the activation dtype as the unfused add would be; h is
        # the next residual (written over `residual`) and the input of the norm.
        x = (x + tl.load(res_ptr + t * stride_r + i, mask=m, other=0.0)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + t * stride_r + i, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, N]: weight * (x / rms(x)), normalized in float32.

    With `residual`, normalizes x + residual instead and leaves that sum in `residual` (in place),
    as `h = x + residual; out = norm(h)` would.
    """
    T, N = x.shape
    out = torch.empty_like(x)
    if T == 0:
        return out
    assert x.stride(1) == 1 and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1))
    res = residual if residual is not None else x
    _rms_norm_kernel[(T,)](
        x, res, weight, out, float(eps), x.stride(0), res.stride(0), out.stride(0),
        N=N, N_PAD=triton.next_power_of_2(N), ADD_RESIDUAL=residual is not None,
    )
    return out


@triton.jit
def _rope_kernel(
    src_ptr,
    dst_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_src,
    stride_dst,
    stride_table,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    m = (h < HEADS) & (d < HALF)
    # The tables hold [cos(f) | cos(f)] per position (rotate-half layout): the first half suffices.
    cos = tl.load(cos_ptr + pos * stride_table + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + d, mask=d < HALF, other=0.0).to(tl.float32)
    base = src_ptr + t * stride_src + h * (2 * HALF) + d
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    out = dst_ptr + t * stride_dst + h * (2 * HALF) + d
    tl.store(out, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=m)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=m)


def _rope_one(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              head_dim: int) -> torch.Tensor:
    T = x.shape[0]
    heads = x.shape[1] // head_dim
    out = torch.empty(T, heads * head_dim, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    assert x.stride(1) == 1 and cos.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    half = head_dim // 2
    _rope_kernel[(T,)](
        x, out, positions, cos, sin, x.stride(0), out.stride(0), cos.stride(0),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )
    return out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half layout) of flat q [T, H*D] and k [T, KVH*D] at `positions`, from the
    [max_position, D] cos/sin tables; returns new contiguous q and k."""
    return _rope_one(q, positions, cos, sin, head_dim), _rope_one(k, positions, cos, sin, head_dim)
