"""The native CPU kernel and the torch backend compute the same paged attention, and both equal
plain causal attention over each request's contiguous keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.cpu_kernel import QUERY_TILE, load_kernel
from pagedllm.attention.metadata import AttentionGroup, AttentionMetadata, DenseAttention
from pagedllm.attention.torch_backend import paged_attention
from pagedllm.worker.input_batch import RequestState, build_batch

H, KVH, D, BS, NUM_BLOCKS = 6, 2, 32, 4, 64


def make_case(seed: int, starts: list[int], n: list[int]):
    """Requests with `starts[i]` cached tokens and `n[i]` new tokens, on shuffled blocks."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(NUM_BLOCKS))
    states = []
    for i, (s, k) in enumerate(zip(starts, n)):
        nblocks = -(-(s + k) // BS)
        blocks = [int(free.pop()) for _ in range(nblocks)]
        states.append(RequestState(f"r{i}", list(range(s + k)), s + k, blocks, s, None))
    return states


def metadata(states, n, window: int, native, dense_min: int = 0) -> AttentionMetadata:
    b = build_batch(states, n, BS, window or None, build_groups=native is None, query_tile=QUERY_TILE,
                    dense_min_tokens=dense_min)
    t = torch.from_numpy
    groups = [
        AttentionGroup(g.batch_size, g.max_query_len, t(g.query_index), t(g.out_rows), t(g.out_dest),
                       t(g.block_tables), t(g.mask))
        for g in b.groups
    ]
    return AttentionMetadata(len(b.input_ids), t(b.slot_mapping), t(b.block_tables), t(b.query_start_loc),
                             t(b.seq_lens), t(b.work), window, groups, native,
                             dense=[DenseAttention(d.query_start, d.query_len, t(d.blocks), d.seq_len) for d in b.dense])


def reference(states, n, q, kv, window: int) -> torch.Tensor:
    """Per request: gather its keys in order and run dense causal attention."""
    outs, row = [], 0
    for s, k in zip(states, n):
        L = s.num_computed_tokens + k
        slots = torch.tensor([s.block_ids[p // BS] * BS + p % BS for p in range(L)])
        keys = kv[0].view(-1, KVH, D)[slots].repeat_interleave(H // KVH, 1).transpose(0, 1)
        vals = kv[1].view(-1, KVH, D)[slots].repeat_interleave(H // KVH, 1).transpose(0, 1)
        qi = q[row : row + k].transpose(0, 1)
        qpos = torch.arange(s.num_computed_tokens, L)[:, None]
        kpos = torch.arange(L)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask)
        outs.append(o.transpose(0, 1).reshape(k, H * D))
        row += k
    return torch.cat(outs)


CASES = [
    ([0, 0, 0], [1, 7, 19]),  # first chunks
    ([5, 12, 0, 30], [1, 1, 9, 1]),  # decodes mixed with a prompt
    ([3, 17, 40], [13, 8, 2]),  # continuation chunks
    ([0, 63 - 9], [64 - 9 - 1, 9]),
]


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("starts,n", CASES)
@pytest.mark.parametrize("backend", ["torch", "native", "native+dense"])
def test_paged_attention_matches_dense(backend, starts, n, window):
    native = load_kernel() if backend != "torch" else None
    if backend != "torch" and native is None:
        pytest.skip("no C compiler for the native kernel")
    states = make_case(len(n) + window, starts, n)
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(2, NUM_BLOCKS, BS, KVH, D, generator=g)
    T = sum(n)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    # native+dense: chunks of 8 tokens or more attend densely (float32: the native flash kernel,
    # each chunk in its own call, the rest of the batch in the paged kernel).
    md = metadata(states, n, window, native, dense_min=8 if backend == "native+dense" else 0)
    assert bool(md.dense) == (backend == "native+dense" and max(n) >= 8)
    out = paged_attention(q, k, v, kv, md, D**-0.5)
    # The new K/V were written into their slots before attention read them.
    assert torch.equal(kv[0].view(-1, KVH, D)[md.slot_mapping], k)
    torch.testing.assert_close(out, reference(states, n, q, kv, window), atol=2e-5, rtol=1e-4)


def test_work_items_split_queries_into_tiles():
    states = make_case(0, [0, 0, 0], [1, 19, 2])
    b = build_batch(states, [1, 19, 2], BS, query_tile=8)
    assert b.work.tolist() == [[0, 0, 1], [1, 0, 8], [1, 8, 8], [1, 16, 3], [2, 0, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_items_give_each_token_the_bits_it_decodes_alone(dtype):
    """A verification step's work items of one token each (query_tile 1: model_runner.token_options)
    give every token of the 5 the bits of that token decoded alone, with the keys up to its own
    position; 5 tokens x 3 query heads per KV head (SmolLM2's heads) in one item would take the
    transposed tiles, whose sums part from the decode form's in some of these cases."""
    from pagedllm.attention.cpu_kernel import paged_attention_native

    native = load_kernel()
    if native is None:
        pytest.skip("no C compiler for the native kernel")
    ctx, n, heads, kv_heads, hd, bs = 100, 5, 9, 3, 64, 16
    for seed in range(4):
        g, t = torch.Generator().manual_seed(seed), torch.from_numpy
        blocks = torch.randperm(NUM_BLOCKS, generator=g)[: -(-(ctx + n) // bs)].tolist()
        b = build_batch([RequestState("r", list(range(ctx + n)), ctx + n, blocks, ctx, None)], [n], bs, query_tile=1)
        assert b.work.tolist() == [[0, i, 1] for i in range(n)]
        kv = torch.randn(2, NUM_BLOCKS, bs, kv_heads, hd, generator=g).to(dtype)
        q = torch.randn(n, heads, hd, generator=g).to(dtype)
        bt = t(b.block_tables)
        out = paged_attention_native(native, q, kv, bt, t(b.query_start_loc), t(b.seq_lens), t(b.work), hd**-0.5, 0)
        for i in range(n):
            alone = paged_attention_native(native, q[i : i + 1], kv, bt, torch.tensor([0, 1]),
                                           torch.tensor([ctx + i + 1]), torch.tensor([[0, 0, 1]]), hd**-0.5, 0)
            assert torch.equal(out[i : i + 1], alone), (seed, i)


# Tolerances of the low-precision caches, against dense float32 attention on the values the cache
# actually holds (so they bound the kernel's arithmetic, not the rounding of the cache): the
# kernel accumulates in float32, and only q's rounding to the query dtype (bf16: 8 mantissa bits,
# relative error 2^-9 per element; fp16: 2^-12) and the output's rounding (same) remain. With
# O(1) scores over D = 32, bf16 gives errors up to a few 1e-3 on O(1) outputs; fp16 about 8x less.
LOW_PRECISION = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("starts,n", CASES[1:3])
def test_native_kernel_half_precision_matches_dense_fp32(dtype, starts, n):
    native = load_kernel()
    if native is None:
        pytest.skip("no C compiler for the native kernel")
    states = make_case(len(n), starts, n)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, NUM_BLOCKS, BS, KVH, D, generator=g).to(dtype)
    T = sum(n)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, KVH, KVH))
    md = metadata(states, n, 0, native)
    out = paged_attention(q, k, v, kv, md, D**-0.5)
    assert out.dtype == dtype
    ref = reference(states, n, q.float(), kv.float(), 0)
    torch.testing.assert_close(out.float(), ref, **LOW_PRECISION[dtype])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_round_trip_and_attention(fp8):
    from pagedllm.attention.torch_backend import gather_kv, to_cache_dtype, write_kv

    native = load_kernel()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, KVH, D, generator=g) * 3
    scale = float(x.abs().max()) / torch.finfo(fp8).max
    back = to_cache_dtype(x, fp8, scale).float() * scale
    # Half an ulp: relative 2^-4 (e4m3, 3 mantissa bits) or 2^-3 (e5m2, 2 bits), and near zero
    # half the smallest subnormal step of e4m3 (2^-10, times the scale).
    rel = 2.0**-4 if fp8 == torch.float8_e4m3fn else 2.0**-3
    assert ((back - x).abs() <= rel * x.abs() + scale * 2.0**-10).all()
    # Values beyond the range saturate instead of turning into NaN.
    assert torch.isfinite(to_cache_dtype(x * 100, fp8, scale).float()).all()

    starts, n = CASES[1]
    states = make_case(1, starts, n)
    kv32 = torch.randn(2, NUM_BLOCKS, BS, KVH, D, generator=g)
    k_scale, v_scale = 0.01, 0.02
    kv = torch.empty(kv32.shape, dtype=fp8)
    kv[0] = to_cache_dtype(kv32[0], fp8, k_scale)
    kv[1] = to_cache_dtype(kv32[1], fp8, v_scale)
    T = sum(n)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    outs = []
    for backend in ("torch", "native"):
        if backend == "native" and native is None:
            continue
        cache = kv.clone()
        md = metadata(states, n, 0, native if backend == "native" else None)
        outs.append(paged_attention(q, k, v, cache, md, D**-0.5, k_scale, v_scale))
    # Against dense float32 attention on the decoded cache (the new K/V written too).
    cache = kv.clone()
    write_kv(cache, k, v, metadata(states, n, 0, None).slot_mapping, k_scale, v_scale)
    all_blocks = torch.arange(NUM_BLOCKS)
    dec = torch.stack([gather_kv(cache, 0, all_blocks, torch.float32, k_scale),
                       gather_kv(cache, 1, all_blocks, torch.float32, v_scale)])
    ref = reference(states, n, q, dec, 0)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_rotary_on_fused_qkv_equals_separate_rotations():
    from types import SimpleNamespace

    from pagedllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), D, 256, torch.float32)
    qkv = torch.randn(5, (H + 2 * KVH) * D)
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    pos = torch.tensor([0, 3, 7, 100, 255])
    fq, fk = rope(pos, q, k)  # adjacent views: one pass
    sq, sk = rope(pos, q.clone(), k.clone())  # separate tensors: two passes
    assert torch.equal(fq, sq) and torch.equal(fk, sk)


# Output rounding of each query dtype (half an ulp: bf16 2^-9, fp16 2^-12, relative): the decode
# path computes q.k exactly in float32 (bf16 x bf16 products are exact, vdpbf16ps accumulates in
# fp32) and accumulates softmax and PV in float32, so against float32 attention on the same
# (rounded) q and cache values only the final rounding to the query dtype remains.
DECODE_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-5, rtol=4e-3),
              torch.float16: dict(atol=1e-5, rtol=1e-3)}


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (8, 1, 32)])
@pytest.mark.parametrize("q_dtype,kv_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16), (torch.bfloat16, torch.float8_e4m3fn)])
def test_decode_path_at_model_shapes_matches_dense_fp32(heads, kv_heads, head_dim, q_dtype, kv_dtype):
    """Decodes (and 2-token steps) over long contexts on 16-slot blocks: the register-blocked decode
    path, with 1-8 query rows per KV head, partial runs at block edges and a sliding window."""
    from pagedllm.attention.cpu_kernel import fp8_table, paged_attention_native

    native = load_kernel()
    if native is None:
        pytest.skip("no C compiler for the native kernel")
    bs, g = 16, torch.Generator().manual_seed(head_dim)
    lens, qlens = [1, 17, 200, 333], [1, 1, 2, 1]
    nblk = [-(-n // bs) for n in lens]
    num_blocks = sum(nblk) + 3
    kv = (torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=g) * 2).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int64)
    for r, n in enumerate(nblk):
        bt[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
    qsl = torch.tensor([0] + qlens).cumsum(0)
    seq = torch.tensor(lens)
    work = torch.tensor([[r, 0, n] for r, n in enumerate(qlens)])
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(q_dtype)
    dec = kv.float() if kv_dtype not in (torch.float8_e4m3fn,) else fp8_table(kv_dtype)[kv.view(torch.uint8).long()]
    for window in (0, 50):
        out = paged_attention_native(native, q, kv, bt, qsl, seq, work, head_dim**-0.5, window)
        refs = []
        for r, (n, ql) in enumerate(zip(lens, qlens)):
            slots = torch.tensor([int(bt[r, p // bs]) * bs + p % bs for p in range(n)])
            keys, vals = (dec[i].view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
                          .transpose(0, 1) for i in (0, 1))
            qpos, kpos = torch.arange(n - ql, n)[:, None], torch.arange(n)[None, :]
            mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
            qi = q[int(qsl[r]) : int(qsl[r + 1])].float().transpose(0, 1)
            refs.append(F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask).transpose(0, 1).reshape(ql, -1))
        torch.testing.assert_close(out.float(), torch.cat(refs), **DECODE_TOL[q_dtype])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_reads_q_in_place_from_fused_rows(q_dtype):
    """q as the model hands it over, a view into the fused QKV rows (tokens ldq > H * D elements
    apart), gives the bits of the same q copied contiguous: decodes and a prompt chunk (the
    transposed-tile path) alike."""
    from pagedllm.attention.cpu_kernel import paged_attention_native

    native = load_kernel()
    if native is None:
        pytest.skip("no C compiler for the native kernel")
    bs, heads, kv_heads, hd, g = 16, 9, 3, 64, torch.Generator().manual_seed(7)
    lens, qlens = [40, 5, 90], [1, 5, 24]  # a decode, a whole 5-token prompt, a 24-token chunk
    nblk = [-(-n // bs) for n in lens]
    kv = torch.randn(2, sum(nblk), bs, kv_heads, hd, generator=g).to(q_dtype)
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int64)
    start = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = torch.arange(start, start + n)
        start += n
    qsl = torch.tensor([0] + qlens).cumsum(0)
    work = torch.tensor([[r, 0, n] for r, n in enumerate(qlens)])
    T = int(qsl[-1])
    qkv = torch.randn(T, (heads + 2 * kv_heads) * hd, generator=g).to(q_dtype)
    q = qkv[:, : heads * hd].view(T, heads, hd)
    assert not q.is_contiguous() and q.stride(0) == (heads + 2 * kv_heads) * hd
    args = (kv, bt, qsl, torch.tensor(lens), work, hd**-0.5, 0)
    assert torch.equal(paged_attention_native(native, q, *args), paged_attention_native(native, q.contiguous(), *args))


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_native_kv_write_equals_index_copy(dtype, tokens):
    """The native KV write (one call for K and V) against index_copy_: equal to the bit, for K/V
    rows read in place from fused q|k|v rows; a slot out of range raises and writes nothing."""
    from pagedllm.attention.cpu_kernel import kv_cache_write
    from pagedllm.attention.torch_backend import write_kv

    g = torch.Generator().manual_seed(tokens)
    nb, bs, kvh, d = 160, 16, 3, 64
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
    ref = cache.clone()
    qkv = torch.randn(tokens, (9 + 2 * kvh) * d, generator=g).to(dtype)
    k = qkv[:, 9 * d:(9 + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (9 + kvh) * d:].view(tokens, kvh, d)
    slots = torch.randperm(nb * bs, generator=g)[:tokens]
    assert kv_cache_write(cache, k, v, slots)  # the native path takes these strided rows
    ref[0].view(nb * bs, kvh, d).index_copy_(0, slots, k)
    ref[1].view(nb * bs, kvh, d).index_copy_(0, slots, v)
    assert torch.equal(cache, ref)
    write_kv(cache, k, v, slots)  # the backend's entry point takes it too
    assert torch.equal(cache, ref)
    bad = slots.clone()
    bad[-1] = nb * bs
    with pytest.raises(IndexError):
        write_kv(cache, k, v, bad)
    assert torch.equal(cache, ref)  # nothing written
    assert not kv_cache_write(cache, k.float() if dtype != torch.float32 else k.double(), v, slots)
