"""Paged attention in plain torch (CPU reference backend).

New K/V are written into their cache slots first; then each group gathers its requests' blocks
through the block table and runs one batched scaled-dot-product attention (the native C kernel,
when available, reads the blocks in place instead) with a mask that
encodes each query's causal limit. Writing before reading lets a request read, in the same pass,
blocks that another request of the batch is filling (a prefix-cache hit on a block being computed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.cpu_kernel import paged_attention_native
from pagedllm.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    nb, bs, kvh, d = kv_cache.shape[1:]
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H * D]."""
    write_kv(kv_cache, k, v, md.slot_mapping)
    if md.native is not None:
        return paged_attention_native(
            md.native, q, kv_cache, md.block_tables, md.query_start_loc, md.seq_lens, md.work, scale, md.sliding_window
        )
    T, H, D = q.shape
    kvh = k.shape[1]
    out = q.new_empty(T, H * D)
    q_pad = torch.cat((q, q.new_zeros(1, H, D)))  # row T is the padding query
    for g in md.groups:
        qg = q_pad.index_select(0, g.query_index).view(g.batch_size, g.max_query_len, H, D).transpose(1, 2)
        # [B, nb, bs, KVH, D] -> [B, KVH, nb * bs, D]
        kg = kv_cache[0][g.block_tables].view(g.batch_size, -1, kvh, D).transpose(1, 2)
        vg = kv_cache[1][g.block_tables].view(g.batch_size, -1, kvh, D).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=kvh != H)
        og = og.transpose(1, 2).reshape(g.batch_size * g.max_query_len, H * D)
        out.index_copy_(0, g.out_dest, og.index_select(0, g.out_rows))
    return out
