"""Paged attention in plain torch (CPU reference backend), and the KV write shared by both backends.

New K/V are written into their cache slots first; then each group gathers its requests' blocks
through the block table and runs one batched scaled-dot-product attention (the native C kernel,
when available, reads the blocks in place instead) with a mask that
encodes each query's causal limit. Writing before reading lets a request read, in the same pass,
blocks that another request of the batch is filling (a prefix-cache hit on a block being computed).

The cache may be narrower than the model dtype: bfloat16/float16, or fp8 holding K / k_scale and
V / v_scale (per-tensor scales) saturated to the format's range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.cpu_kernel import (
    FP8_DTYPES,
    flash_prefill,
    flash_supported,
    kv_cache_write,
    paged_attention_native,
)
from pagedllm.attention.metadata import AttentionMetadata, DenseAttention


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache's dtype: fp8 codes of x / scale (saturated), else a plain cast."""
    if dtype in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        return (x.float() * (1.0 / scale)).clamp_(-fmax, fmax).to(dtype)
    return x.to(dtype)


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    nb, bs, kvh, d = kv_cache.shape[1:]
    dt = kv_cache.dtype
    if dt in FP8_DTYPES:  # index_copy_ has no fp8 kernel: copy the one-byte codes
        kv_cache[0].view(torch.uint8).view(nb * bs, kvh, d).index_copy_(
            0, slot_mapping, to_cache_dtype(k, dt, k_scale).view(torch.uint8))
        kv_cache[1].view(torch.uint8).view(nb * bs, kvh, d).index_copy_(
            0, slot_mapping, to_cache_dtype(v, dt, v_scale).view(torch.uint8))
        return
    if kv_cache_write(kv_cache, k, v, slot_mapping):  # same dtype on the CPU: one native call
        return
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(dt))
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(dt))


def gather_kv(kv_cache: torch.Tensor, which: int, index: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Blocks `index` of the K (0) or V (1) cache, decoded to `dtype` (times the fp8 scale)."""
    cache = kv_cache[which]
    if cache.dtype in FP8_DTYPES:
        return (cache.view(torch.uint8)[index].view(cache.dtype).float() * scale).to(dtype)
    return cache[index].to(dtype)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """torch's CPU flash attention on [H, Lq, D] / [H, Lk, D]: (out [H, Lq, D], logsumexp [H, Lq])."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale)
    return o[0], lse[0]


def dense_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, d: DenseAttention, scale: float, k_scale: float, v_scale: float,
    sliding_window: int = 0, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One long chunk: gather its context once, then fused flash attention (GEMM-shaped tiles).
    -> [query_len, H * D]; the native kernel writes it into `out` (the chunk's rows of the step's
    output) when given, the torch path copies it there.

    bf16 queries over a bf16 cache, and float32 over float32, take the native flash kernel instead
    (flash_attention.c: AMX tiles or vdpbf16ps, or float32 FMAs on float32 or widened bf16, for Q K^T and P V,
    reading the blocks in place), unless PAGEDLLM_NATIVE_FLASH=0 (or, for the kernel's AVX2 form,
    the chunk is large enough that torch's is faster: cpu_kernel.flash_takes). A `sliding_window`
    > 0 limits each query to that many keys ending at its own position.
    """
    if flash_supported(q, kv_cache, d.query_len, d.seq_len, sliding_window):
        o = flash_prefill(q, kv_cache, d.blocks, d.query_start, d.query_len, d.seq_len, scale, sliding_window, out)
        if o is not None:  # None: the kernel found no memory for its buffers
            return o
    o = dense_attention_sdpa(q, kv_cache, d, scale, k_scale, v_scale, sliding_window)
    return o if out is None else out.copy_(o)


def window_mask(query_len: int, seq_len: int, sliding_window: int) -> torch.Tensor:
    """[query_len, seq_len] bool, True where a query may see a key: the chunk's queries sit at the
    last query_len positions and see the `sliding_window` keys ending at their own position.

    query_len 2, seq_len 5, window 3 -> [0,1,1,1,0], [0,0,1,1,1].
    """
    qpos = torch.arange(seq_len - query_len, seq_len)[:, None]
    kpos = torch.arange(seq_len)[None, :]
    return (kpos <= qpos) & (kpos > qpos - sliding_window)


def dense_attention_sdpa(
    q: torch.Tensor, kv_cache: torch.Tensor, d: DenseAttention, scale: float, k_scale: float, v_scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """dense_attention through torch: the context gathered once, then torch's CPU flash attention.
    -> [query_len, H * D].

    The chunk's queries see the cached context [0, ctx0) fully and the chunk itself causally, so
    the two parts run as an unmasked and a causal (square, masked tiles skipped) flash call, merged
    by their log-sum-exps: o = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2). A sliding window
    takes one masked SDPA call instead.
    """
    _, H, D = q.shape
    kvh = kv_cache.shape[3]
    # [nblocks, bs, KVH, D] -> [KVH, seq_len, D]
    k = gather_kv(kv_cache, 0, d.blocks, q.dtype, k_scale).view(-1, kvh, D)[: d.seq_len].transpose(0, 1)
    v = gather_kv(kv_cache, 1, d.blocks, q.dtype, v_scale).view(-1, kvh, D)[: d.seq_len].transpose(0, 1)
    qd = q[d.query_start : d.query_start + d.query_len].transpose(0, 1)  # [H, q, D]
    if sliding_window:
        mask = window_mask(d.query_len, d.seq_len, sliding_window).to(q.device)
        o = F.scaled_dot_product_attention(qd[None], k[None], v[None], attn_mask=mask, scale=scale,
                                           enable_gqa=kvh != H)[0]
        return o.transpose(0, 1).reshape(d.query_len, H * D)
    if kvh != H:
        k, v = k.repeat_interleave(H // kvh, 0), v.repeat_interleave(H // kvh, 0)
    ctx0 = d.seq_len - d.query_len
    o, lse = _flash(qd, k[:, ctx0:], v[:, ctx0:], True, scale)
    if ctx0 > 0:
        o1, lse1 = _flash(qd, k[:, :ctx0], v[:, :ctx0], False, scale)
        m = torch.maximum(lse, lse1)
        w, w1 = (lse - m).exp_().unsqueeze(-1), (lse1 - m).exp_().unsqueeze(-1)
        o = ((o.float() * w + o1.float() * w1) / (w + w1)).to(q.dtype)
    return o.transpose(0, 1).reshape(d.query_len, H * D)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H * D]."""
    write_kv(kv_cache, k, v, md.slot_mapping, k_scale, v_scale)
    if md.native is not None:
        out = paged_attention_native(
            md.native, q, kv_cache, md.block_tables, md.query_start_loc, md.seq_lens, md.work, scale,
            md.sliding_window, k_scale, v_scale,
        )
        for d in md.dense:
            dense_attention(q, kv_cache, d, scale, k_scale, v_scale, md.sliding_window,
                            out[d.query_start : d.query_start + d.query_len])
        return out
    T, H, D = q.shape
    kvh = k.shape[1]
    out = q.new_empty(T, H * D)
    q_pad = torch.cat((q, q.new_zeros(1, H, D)))  # row T is the padding query
    for g in md.groups:
        qg = q_pad.index_select(0, g.query_index).view(g.batch_size, g.max_query_len, H, D).transpose(1, 2)
        # [B, nb, bs, KVH, D] -> [B, KVH, nb * bs, D]
        kg = gather_kv(kv_cache, 0, g.block_tables, q.dtype, k_scale).view(g.batch_size, -1, kvh, D).transpose(1, 2)
        vg = gather_kv(kv_cache, 1, g.block_tables, q.dtype, v_scale).view(g.batch_size, -1, kvh, D).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=kvh != H)
        og = og.transpose(1, 2).reshape(g.batch_size * g.max_query_len, H * D)
        out.index_copy_(0, g.out_dest, og.index_select(0, g.out_rows))
    return out
