"""Batched LoRA deltas on the GPU (and, for tests, the CPU under Triton's interpreter): the rows of
every adapter in a step in two launches per layer, shrink then expand, punica's SGMV.

    shrink   h[t] = x[t] A_s^T                   (n = slices * R outputs, float32 sums, h rounded
                                                  to the adapters' dtype as the torch path's GEMM is,
                                                  where the expand reads it)
    expand   y[t, lo_j:hi_j] += h[t, j*R:(j+1)*R] B_s^T[j*R:(j+1)*R, lo_j:hi_j]   for each slice j

for each row t of slot s = slots[t] >= 0, from the layer's slot stacks as the CPU kernel reads them
(A [S, n, K], B^T [S, n, N], `ranges` [slices, 2]: each slice's output columns; no copy). The rows
are ordered by slot once per step on the host (`slot_order`): a program takes a block of rows of
one slot, so each load of A or B^T serves the whole block (tl.dot); a row without an adapter is in
no block and costs nothing. The grid is (row blocks, column blocks, slots): its size depends only
on the step's row count, never on which rows have which adapter, so a CUDA graph captured with
these launches stays valid when the slots' contents or the rows' slots change.

Rounding follows the torch path (x in the adapters' dtype, h and the delta rounded to it, the
delta then to y's dtype and added in float32); float32 dots run in IEEE float32, not TF32. Under
Triton's interpreter (whose tl.dot misreads 16-bit operands) 16-bit operands are widened to
float32 first: their products are exact in float32 either way, so only the order of the float32
sums can differ from the GPU's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_K = 64


@triton.jit
def _rows(meta_ptr, s, pm, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's rows (their indices in x) and their mask: block pm of slot s's rows."""
    start = tl.load(meta_ptr + s)
    count = tl.load(meta_ptr + s + 1) - start
    offs = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(meta_ptr + NUM_SLOTS + 1 + start + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask, pm * BLOCK_M < count


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, meta_ptr, K, N, K_PER, stride_xm, stride_xk, stride_as, stride_hs, stride_hm,
                   NUM_SLOTS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    s = tl.program_id(2) // SPLIT
    part = tl.program_id(2) % SPLIT
    rows, mrow, any_rows = _rows(meta_ptr, s, pm, NUM_SLOTS, BLOCK_M)
    if any_rows:
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mcol = cols < N
        a_base = a_ptr + s.to(tl.int64) * stride_as
        k_lo = part * K_PER
        k_hi = tl.minimum(K, k_lo + K_PER)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mk = ks < k_hi
            xb = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                         mask=mrow[:, None] & mk[None, :], other=0.0).to(a_ptr.dtype.element_ty)
            ab = tl.load(a_base + cols[None, :].to(tl.int64) * K + ks[:, None], mask=mcol[None, :] & mk[:, None],
                         other=0.0)
            if IEEE:
                acc += tl.dot(xb.to(tl.float32), ab.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xb, ab)
        tl.store(h_ptr + part * stride_hs + rows[:, None] * stride_hm + cols[None, :], acc,
                 mask=mrow[:, None] & mcol[None, :])


@triton.jit
def _expand_kernel(h_ptr, bt_ptr, y_ptr, meta_ptr, ranges_ptr, R, N, stride_hs, stride_hm, stride_bs, stride_ym,
                   NUM_SLOTS: tl.constexpr, SPLIT: tl.constexpr, NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    s = tl.program_id(2)
    rows, mrow, any_rows = _rows(meta_ptr, s, pm, NUM_SLOTS, BLOCK_M)
    if any_rows:
        first = pn * BLOCK_N
        cols = first + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, R_PAD)
        mr = rk < R
        b_base = bt_ptr + s.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(NUM_SLICES):
            lo = tl.load(ranges_ptr + 2 * j)
            hi = tl.load(ranges_ptr + 2 * j + 1)
            if (lo < first + BLOCK_N) & (hi > first):  # this slice owns some of the block's columns
                mc = (cols >= lo) & (cols < hi)
                # h: the shrink's float32 parts summed in order, then rounded to the adapters' dtype
                hp = h_ptr + rows[:, None] * stride_hm + j * R + rk[None, :]
                hb = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
                for part in tl.static_range(SPLIT):
                    hb += tl.load(hp + part * stride_hs, mask=mrow[:, None] & mr[None, :], other=0.0)
                hb = hb.to(bt_ptr.dtype.element_ty)
                bb = tl.load(b_base + (j * R + rk[:, None]).to(tl.int64) * N + cols[None, :],
                             mask=mr[:, None] & mc[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(hb.to(tl.float32), bb.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(hb, bb)
        mo = mrow[:, None] & (cols < N)[None, :]
        yp = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        y = tl.load(yp, mask=mo, other=0.0).to(tl.float32)
        d = acc.to(bt_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(yp, (y + d).to(y_ptr.dtype.element_ty), mask=mo)


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 64 else 64


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor,
                       ranges: torch.Tensor, rank: int, meta: torch.Tensor, max_rows: int) -> None:
    """y[t] += the delta of row t's adapter, for the rows `meta` orders by slot (slot_order's
    [starts (S + 1) | rows]); `max_rows` bounds the rows of any one slot (the grid's row blocks).
    x [T, K], y [T, N] (row stride free, columns contiguous), lora_a [S, slices * rank, K],
    lora_bt [S, slices * rank, N], ranges [slices, 2] int64: all on one device."""
    num_slots, n, k = lora_a.shape
    num_slices, out = len(ranges), lora_bt.shape[2]
    if max_rows == 0 or x.shape[0] == 0:
        return
    assert lora_a.is_contiguous() and lora_bt.is_contiguous() and y.stride(1) == 1 and ranges.is_contiguous()
    bm = _block_m(max_rows)
    ieee = lora_a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    # A few rows (decode steps) give the shrink too few programs for a long K: its K is cut into
    # up to 8 parts, each summed in float32 apart and added in order by the expand (the same
    # bits at every run). Many rows have programs enough.
    split = min(8, max(1, k // BLOCK_K)) if max_rows <= 64 else 1
    k_per = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    h = torch.empty(split, x.shape[0], n, dtype=torch.float32, device=x.device)
    bn = max(16, min(64, triton.next_power_of_2(n)))
    _shrink_kernel[(triton.cdiv(max_rows, bm), triton.cdiv(n, bn), num_slots * split)](
        x, lora_a, h, meta, k, n, k_per, x.stride(0), x.stride(1), lora_a.stride(0), h.stride(0), h.stride(1),
        NUM_SLOTS=num_slots, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, IEEE=ieee)
    bn = 64
    _expand_kernel[(triton.cdiv(max_rows, bm), triton.cdiv(out, bn), num_slots)](
        h, lora_bt, y, meta, ranges, rank, out, h.stride(0), h.stride(1), lora_bt.stride(0), y.stride(0),
        NUM_SLOTS=num_slots, SPLIT=split, NUM_SLICES=num_slices, R_PAD=max(16, triton.next_power_of_2(rank)),
        BLOCK_M=bm, BLOCK_N=bn, IEEE=ieee)
