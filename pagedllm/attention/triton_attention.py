"""Paged attention in Triton (GPU): one kernel for a flat batch of decode tokens and prompt chunks.

Work items come from the runner's numpy batch (`BatchArrays.work`: request, first query token,
number of tokens; at most `query_tile(...)` tokens each). One program handles one work item and
one KV head: its rows are (query token, query head of that KV head's GQA group) pairs, so the
keys and values of a block are read once for all the heads that share them. It walks the
request's keys through the block table in tiles of TILE_N tokens (several cache blocks per tile
when blocks are small), with an online softmax in float32:

    work item (req 3, first 8, count 4), 4 query heads per KV head -> 16 rows:
    row r -> query token 8 + r // 4 of request 3, query head kvh * 4 + r % 4

Each row sees keys up to its own position (causal within the chunk, everything before it) and,
with a sliding window W, only the last W of them. For long contexts with few programs (a few
decodes), the key range is split over NUM_SPLITS programs that write partial results (max,
sum, weighted values) which a second kernel combines.

The KV cache may hold float8 (e4m3) values; keys and values are then multiplied by their scale
as they are loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows of one program (query tokens x heads of one GQA group) in a prompt chunk.
_TARGET_ROWS = 64
# Keys per inner-loop tile (a multiple of every supported block size up to 64).
_TILE_N = 64
_MAX_SPLITS = 16
_LOG2E = 1.4426950408889634


def check_block_size(block_size: int) -> None:
    """The kernel reads blocks in tiles of 64 keys: block sizes must be powers of 2 up to 64."""
    if block_size > _TILE_N or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size} is not supported by the Triton attention kernel (GPU): use 16, 32 or 64"
        )


def query_tile(num_queries_per_kv: int) -> int:
    """Query tokens per work item, so that one program holds about 64 rows (tokens x heads)."""
    return max(1, _TARGET_ROWS // num_queries_per_kv)


def choose_num_splits(num_work: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one work item's key range (1: no split).

    Splitting pays when there are fewer programs than streaming multiprocessors and each split
    still has a few tiles of keys: 4 decodes x 8 KV heads over 8k tokens on 132 SMs -> 4 splits.
    """
    programs = num_work * num_kv_heads
    tiles = -(-max_seq_len // _TILE_N)
    if programs >= num_sms or tiles < 8:
        return 1
    splits = 1
    while splits < _MAX_SPLITS and programs * splits * 2 <= num_sms and tiles // (splits * 2) >= 4:
        splits *= 2
    return splits


@triton.jit
def _e4m3_bits(x):
    """float32 -> float8 e4m3fn bit pattern (round to nearest even, saturating at +-448)."""
    sign = ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 7
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # Normal numbers: round the 23-bit mantissa to 3 bits (a carry moves into the exponent),
    # then rebias the exponent from 127 to 7.
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Below 2^-6 the format is subnormal: multiples of 2^-9, rounded to nearest even by the
    # float32 adder (1.5 * 2^23 pushes the fraction out of the mantissa).
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_vt,
    stride_cb,
    stride_cs,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    blk = tl.maximum(slot, 0) // BLOCK_SIZE
    off = tl.maximum(slot, 0) % BLOCK_SIZE
    i = tl.arange(0, ROW_PAD)
    m = (i < ROW) & (slot >= 0)  # slot -1: a padding token, nothing to write
    k = tl.load(k_ptr + t * stride_kt + i, mask=m, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + i, mask=m, other=0.0)
    dst = blk.to(tl.int64) * stride_cb + off * stride_cs + i
    if FP8:
        tl.store(k_cache_ptr + dst, _e4m3_bits(k.to(tl.float32) / k_scale), mask=m)
        tl.store(v_cache_ptr + dst, _e4m3_bits(v.to(tl.float32) / v_scale), mask=m)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes k, v [T, KVH, D] into kv_cache [2, num_blocks, block_size, KVH, D] at their slots.

    Slots below 0 are skipped (padding rows of a CUDA graph). A float8 cache stores
    k / k_scale and v / v_scale, rounded to nearest even.
    """
    T = k.shape[0]
    if T == 0:
        return
    _, _, bs, kvh, d = kv_cache.shape
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
    assert k.stride(2) == 1 and k.stride(1) == d and v.stride(2) == 1 and v.stride(1) == d
    row = kvh * d
    _write_kv_kernel[(T,)](
        k,
        v,
        cache[0],
        cache[1],
        slot_mapping,
        float(k_scale),
        float(v_scale),
        k.stride(0),
        v.stride(0),
        cache.stride(1),
        cache.stride(2),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
        BLOCK_SIZE=bs,
        FP8=fp8,
    )


@triton.jit
def _work_rows(work_ptr, query_start_loc_ptr, w, kvh, QPK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Work item w's request, first query token, token count and first flat row; and per program
    row its query token (within the item), query head and flat token index."""
    req = tl.load(work_ptr + w * 3)
    q_first = tl.load(work_ptr + w * 3 + 1)
    q_count = tl.load(work_ptr + w * 3 + 2)
    q_begin = tl.load(query_start_loc_ptr + req)
    offs_m = tl.arange(0, BLOCK_M)
    q_tok = offs_m // QPK
    head = kvh * QPK + offs_m % QPK
    tok = (q_begin + q_first + q_tok).to(tl.int64)
    return req, q_first, q_count, q_begin, q_tok, head, tok


@triton.jit
def _store_rows(out_ptr, acc, total, tok, head, offs_d, mask, stride_ot, stride_oh):
    """The program's rows acc / total (0 where no key was seen) into the output at their token and
    query head."""
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    work_ptr,
    part_out_ptr,
    part_ml_ptr,
    scale_log2,
    k_scale,
    v_scale,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    QPK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr,
    USE_SW: tl.constexpr,
    IEEE: tl.constexpr,
):
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, q_first, q_count, q_begin, q_tok, head, tok = _work_rows(work_ptr, query_start_loc_ptr, w, kvh, QPK, BLOCK_M)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - (q_end - q_begin)  # tokens cached before this step's chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, TILE_N)
    row_ok = q_tok < q_count
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = context + q_first + q_tok

    # Keys this tile of queries can see: [lo, hi), lo aligned to a tile.
    hi = tl.minimum(context + q_first + q_count, seq_len)
    lo = 0
    if USE_SW:
        lo = tl.maximum(context + q_first - sliding_window + 1, 0)
        lo = (lo // TILE_N) * TILE_N
    if NUM_SPLITS > 1:
        tiles = tl.cdiv(hi - lo, TILE_N)
        per_split = tl.cdiv(tiles, NUM_SPLITS)
        lo = lo + split * per_split * TILE_N
        hi = tl.minimum(hi, lo + per_split * TILE_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, TILE_N):
        kpos = start + offs_n
        k_ok = kpos < hi
        blk = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = blk * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        k = tl.load(k_cache_ptr + slot[None, :] + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if FP8:
            k = (k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        ok = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        if USE_SW:
            ok = ok & (kpos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:
        # Partials at [work item, KV head, split, row]: values [.., D_PAD], then (max, sum).
        base = ((w * tl.num_programs(1) + kvh) * NUM_SPLITS + split).to(tl.int64) * BLOCK_M + offs_m
        tl.store(part_out_ptr + base[:, None] * D_PAD + offs_d[None, :], acc)
        tl.store(part_ml_ptr + base * 2, m_i)
        tl.store(part_ml_ptr + base * 2 + 1, l_i)
    else:
        _store_rows(out_ptr, acc, l_i, tok, head, offs_d, row_ok[:, None] & d_ok[None, :], stride_ot, stride_oh)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    query_start_loc_ptr,
    work_ptr,
    part_out_ptr,
    part_ml_ptr,
    stride_ot,
    stride_oh,
    QPK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    _, _, q_count, _, q_tok, head, tok = _work_rows(work_ptr, query_start_loc_ptr, w, kvh, QPK, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, NUM_SPLITS)
    first = (w * tl.num_programs(1) + kvh).to(tl.int64) * NUM_SPLITS
    rows = (first + offs_s[:, None]) * BLOCK_M + offs_m[None, :]  # [S, BLOCK_M]
    ms = tl.load(part_ml_ptr + rows * 2)
    ls = tl.load(part_ml_ptr + rows * 2 + 1)
    m = tl.max(ms, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.math.exp2(ms - m[None, :])  # [S, BLOCK_M]; 0 for empty splits
    total = tl.sum(weight * ls, 0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        wt = tl.sum(tl.where(offs_s[:, None] == s, weight, 0.0), 0)
        part = tl.load(part_out_ptr + ((first + s) * BLOCK_M + offs_m)[:, None] * D_PAD + offs_d[None, :])
        acc += wt[:, None] * part
    mask = (q_tok < q_count)[:, None] & (offs_d < HEAD_DIM)[None, :]
    _store_rows(out_ptr, acc, total, tok, head, offs_d, mask, stride_ot, stride_oh)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    work: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    max_query_len: int = 0,
    num_splits: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, H, D] against the paged cache [2, num_blocks, block_size, KVH, D] -> [T, H * D].

    `work` [W, 3] (request, first query token, count) covers every query token once;
    `max_query_len` bounds the counts (0: `query_tile` of the GQA group, the largest a work
    item holds). Requests with sequence length 0 (padding) produce zeros.
    """
    T, H, D = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    check_block_size(bs)
    qpk = H // kvh
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    W = work.shape[0]
    if W == 0:
        return out.view(T, H * D)
    rows = qpk * min(max_query_len or query_tile(qpk), query_tile(qpk))
    block_m = max(16, triton.next_power_of_2(rows))
    d_pad = max(16, triton.next_power_of_2(D))
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
    splits = max(1, int(num_splits))
    if splits & (splits - 1):
        raise ValueError(f"num_splits={num_splits} must be a power of 2")
    if splits > 1:
        part_out = torch.empty(W * kvh * splits * block_m, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(W * kvh * splits * block_m, 2, dtype=torch.float32, device=q.device)
    else:
        part_out = part_ml = out  # unused
    _attention_kernel[(W, kvh, splits)](
        q,
        cache[0],
        cache[1],
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        work,
        part_out,
        part_ml,
        float(scale) * _LOG2E,
        float(k_scale),
        float(v_scale),
        int(sliding_window),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        block_tables.stride(0),
        QPK=qpk,
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_SIZE=bs,
        TILE_N=_TILE_N,
        BLOCK_M=block_m,
        NUM_SPLITS=splits,
        FP8=fp8,
        USE_SW=sliding_window > 0,
        IEEE=q.dtype == torch.float32,
    )
    if splits > 1:
        _combine_splits_kernel[(W, kvh)](
            out,
            query_start_loc,
            work,
            part_out,
            part_ml,
            out.stride(0),
            out.stride(1),
            QPK=qpk,
            HEAD_DIM=D,
            D_PAD=d_pad,
            BLOCK_M=block_m,
            NUM_SPLITS=splits,
        )
    return out.view(T, H * D)

