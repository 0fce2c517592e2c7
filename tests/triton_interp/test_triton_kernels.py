"""The Triton kernels against the torch reference, under Triton's interpreter on the CPU.

Run through tests/unit/test_triton_interpreter.py, which starts this folder in a subprocess with
TRITON_INTERPRET=1 (set before triton is imported, so it cannot leak into other tests); or
directly: `TRITON_INTERPRET=1 python -m pytest tests/triton_interp`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.worker.input_batch import RequestState, build_batch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from pagedllm.attention import triton_attention as ta  # noqa: E402

pytestmark = pytest.mark.triton_interp
NUM_BLOCKS = 48


def make_states(rng, starts: list[int], n: list[int], bs: int) -> list[RequestState]:
    """Requests with starts[i] cached tokens and n[i] new ones, on shuffled blocks."""
    free = list(rng.permutation(NUM_BLOCKS))
    states = []
    for i, (s, k) in enumerate(zip(starts, n)):
        blocks = [int(free.pop()) for _ in range(-(-(s + k) // bs))]
        states.append(RequestState(f"r{i}", list(range(s + k)), s + k, blocks, s, None))
    return states


def reference(states, n, q, kv, window: int, bs: int) -> torch.Tensor:
    """Per request: its keys in order, dense causal (and windowed) attention in float32."""
    H, D = q.shape[1], q.shape[2]
    kvh = kv.shape[3]
    outs, row = [], 0
    for s, k in zip(states, n):
        L = s.num_computed_tokens + k
        slots = torch.tensor([s.block_ids[p // bs] * bs + p % bs for p in range(L)])
        keys = kv[0].reshape(-1, kvh, D)[slots].float().repeat_interleave(H // kvh, 1).transpose(0, 1)
        vals = kv[1].reshape(-1, kvh, D)[slots].float().repeat_interleave(H // kvh, 1).transpose(0, 1)
        qi = q[row : row + k].float().transpose(0, 1)
        qpos = torch.arange(s.num_computed_tokens, L)[:, None]
        kpos = torch.arange(L)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, scale=D**-0.5)
        outs.append(o.transpose(0, 1).reshape(k, H * D))
        row += k
    return torch.cat(outs)


def run_case(starts, n, H, KVH, D, bs, window=0, dtype=torch.float32, num_splits=1, seed=0):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    states = make_states(rng, starts, n, bs)
    qpk = H // KVH
    b = build_batch(states, n, bs, window or None, build_groups=False, query_tile=ta.query_tile(qpk))
    T = len(b.input_ids)
    kv = torch.randn(2, NUM_BLOCKS, bs, KVH, D).to(dtype)
    q = torch.randn(T, H, D).to(dtype)
    k_new = torch.randn(T, KVH, D).to(dtype)
    v_new = torch.randn(T, KVH, D).to(dtype)
    slots = torch.from_numpy(b.slot_mapping)
    ta.write_kv(kv, k_new, v_new, slots)
    assert torch.equal(kv[0].reshape(-1, KVH, D)[slots], k_new)
    assert torch.equal(kv[1].reshape(-1, KVH, D)[slots], v_new)
    out = ta.paged_attention(
        q, kv, torch.from_numpy(b.block_tables), torch.from_numpy(b.query_start_loc), torch.from_numpy(b.seq_lens),
        torch.from_numpy(b.work), D**-0.5, window, max_query_len=max(n), num_splits=num_splits,
    )
    ref = reference(states, n, q, kv, window, bs)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("bs", [16, 32])
def test_mixed_decode_and_prefill_gqa(bs):
    # Two decodes, a chunk continuing a cached prefix, a fresh prompt; last blocks partly filled.
    run_case(starts=[37, 5, 20, 0], n=[1, 1, 13, 29], H=8, KVH=2, D=32, bs=bs)


def test_prefill_longer_than_a_work_item_mha_half_precision():
    run_case(starts=[3, 0], n=[70, 1], H=2, KVH=2, D=64, bs=16, dtype=torch.float16)


def test_sliding_window():
    run_case(starts=[90, 0, 40], n=[1, 50, 9], H=4, KVH=1, D=32, bs=16, window=24)


def test_split_k_matches_one_pass():
    run_case(starts=[150, 7, 0], n=[1, 1, 12], H=4, KVH=2, D=32, bs=16, num_splits=4)
    run_case(starts=[150, 0], n=[1, 3], H=4, KVH=2, D=32, bs=32, window=40, num_splits=2)


def test_padding_rows_write_nothing_and_read_zeros():
    """Slot -1 and sequence length 0: what CUDA graph padding rows use."""
    kv = torch.randn(2, 4, 16, 1, 16)
    before = kv.clone()
    k = torch.randn(2, 1, 16)
    ta.write_kv(kv, k, k, torch.tensor([-1, 5]))
    assert torch.equal(kv[:, 0, 6:], before[:, 0, 6:]) and torch.equal(kv[0, 0, 5], k[1])
    assert torch.equal(kv[:, 1:], before[:, 1:])
    q = torch.randn(2, 1, 16)
    out = ta.paged_attention(
        q, kv, torch.zeros(2, 2, dtype=torch.int64), torch.tensor([0, 1, 2]), torch.tensor([3, 0]),
        torch.tensor([[0, 0, 1], [1, 0, 1]]), 0.25, max_query_len=1,
    )
    assert torch.equal(out[1], torch.zeros(16))


def test_fp8_kv_write_rounds_like_torch_and_attention_reads_scaled():
    torch.manual_seed(0)
    KVH, D, bs = 2, 32, 16
    kv = torch.zeros(2, 8, bs, KVH, D, dtype=torch.float8_e4m3fn)
    k = torch.randn(20, KVH, D) * 4
    k[0, 0, :6] = torch.tensor([1e-3, -3e-3, 0.0, 500.0, -1000.0, 1.96])  # subnormal, zero, saturating
    v = torch.randn(20, KVH, D)
    slots = torch.randperm(8 * bs)[:20]
    ta.write_kv(kv, k, v, slots, k_scale=0.5, v_scale=2.0)
    got_k = kv[0].reshape(-1, KVH, D)[slots]
    got_v = kv[1].reshape(-1, KVH, D)[slots]
    want_k = (k / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_v = (v / 2.0).to(torch.float8_e4m3fn)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    # Attention over the fp8 cache equals attention over its dequantized copy.
    q = torch.randn(20, 4, D)
    table = torch.zeros(1, 8, dtype=torch.int64)
    table[0, :2] = torch.tensor([3, 6])
    ta.write_kv(kv, k, v, torch.cat([torch.arange(3 * bs, 4 * bs), torch.arange(6 * bs, 6 * bs + 4)]), 0.5, 2.0)
    deq = torch.stack([kv[0].float() * 0.5, kv[1].float() * 2.0])
    args = (table, torch.tensor([0, 20]), torch.tensor([20]), torch.tensor([[0, 0, 16], [0, 16, 4]]), D**-0.5)
    out8 = ta.paged_attention(q, kv, *args, max_query_len=16, k_scale=0.5, v_scale=2.0)
    out32 = ta.paged_attention(q, deq, *args, max_query_len=16)
    torch.testing.assert_close(out8, out32, atol=1e-5, rtol=1e-5)


def test_num_splits_choice():
    assert ta.choose_num_splits(256, 8, 8192, 132) == 1  # enough programs already
    assert ta.choose_num_splits(1, 8, 100, 132) == 1  # too few keys to share
    assert ta.choose_num_splits(4, 8, 8192, 132) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_rms_norm_with_and_without_residual(dtype):
    from pagedllm.attention.triton_fused import rms_norm
    from pagedllm.layers.rmsnorm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x = torch.randn(7, 96).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-5), norm(x), **tol)
    residual = torch.randn(7, 96).to(dtype)
    h = x + residual
    out = rms_norm(x, norm.weight, 1e-5, residual=residual)
    assert torch.equal(residual, h)  # the sum is left in the residual buffer
    torch.testing.assert_close(out, norm(h), **tol)


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [(9, 3, 64, torch.float32), (4, 2, 32, torch.float16)])
def test_fused_rotary_matches_the_layer(heads, kv_heads, head_dim, dtype):
    from transformers import LlamaConfig

    from pagedllm.attention.triton_fused import rotary
    from pagedllm.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rope = RotaryEmbedding(config, head_dim, 256, dtype)
    torch.manual_seed(0)
    qkv = torch.randn(11, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 256, (11,))
    got_q, got_k = rotary(positions, q, k, rope.cos, rope.sin, head_dim)
    want_q, want_k = rope(positions, q, k)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
