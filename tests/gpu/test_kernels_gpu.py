"""The Triton kernels on a GPU at real sizes (Llama-3-8B heads), against a float32 torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.worker.input_batch import RequestState, build_batch

pytestmark = pytest.mark.gpu
H, KVH, D = 32, 8, 128


def case(starts: list[int], n: list[int], bs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    need = sum(-(-(s + k) // bs) for s, k in zip(starts, n))
    free = list(rng.permutation(need + 8))
    states = []
    for i, (s, k) in enumerate(zip(starts, n)):
        blocks = [int(free.pop()) for _ in range(-(-(s + k) // bs))]
        states.append(RequestState(f"r{i}", [0] * (s + k), s + k, blocks, s, None))
    return states, need + 8


def reference(states, n, q, kv, window: int, bs: int) -> torch.Tensor:
    outs, row = [], 0
    for s, k in zip(states, n):
        L = s.num_computed_tokens + k
        pos = torch.arange(L, device=q.device)
        table = torch.tensor(s.block_ids, device=q.device)
        slots = table[pos // bs] * bs + pos % bs
        keys = kv[0].reshape(-1, KVH, D)[slots].float().repeat_interleave(H // KVH, 1).transpose(0, 1)
        vals = kv[1].reshape(-1, KVH, D)[slots].float().repeat_interleave(H // KVH, 1).transpose(0, 1)
        qi = q[row : row + k].float().transpose(0, 1)
        qpos = torch.arange(s.num_computed_tokens, L, device=q.device)[:, None]
        mask = pos[None, :] <= qpos
        if window:
            mask &= pos[None, :] > qpos - window
        o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, scale=D**-0.5)
        outs.append(o.transpose(0, 1).reshape(k, H * D))
        row += k
    return torch.cat(outs)


@pytest.mark.parametrize("bs,window", [(16, 0), (32, 0), (64, 0), (16, 1000)])
def test_mixed_batch_at_real_sizes(bs: int, window: int) -> None:
    from pagedllm.attention import triton_attention as ta
    from pagedllm.worker.device import num_sms

    torch.manual_seed(0)
    starts, n = [4000, 17, 0, 700, 2500], [1, 1, 600, 300, 1]
    states, num_blocks = case(starts, n, bs)
    b = build_batch(states, n, bs, window or None, build_groups=False, query_tile=ta.query_tile(H // KVH))
    dev = torch.device("cuda")
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    kv = torch.randn(2, num_blocks, bs, KVH, D, dtype=torch.bfloat16, device=dev)
    T = len(b.input_ids)
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device=dev)
    k = torch.randn(T, KVH, D, dtype=torch.bfloat16, device=dev)
    ta.write_kv(kv, k, k, t(b.slot_mapping))
    assert torch.equal(kv[0].reshape(-1, KVH, D)[t(b.slot_mapping)], k)
    ref = reference(states, n, q, kv, window, bs)
    assert ta.choose_num_splits(len(b.work), KVH, int(b.seq_lens.max()), num_sms(dev)) == 1  # many programs
    for s in (1, 8):  # the one-pass path, and the split path forced
        out = ta.paged_attention(q, kv, t(b.block_tables), t(b.query_start_loc), t(b.seq_lens), t(b.work),
                                 D**-0.5, window, int(b.work[:, 2].max()), s)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_long_context_decodes_use_split_k_and_match() -> None:
    from pagedllm.attention import triton_attention as ta
    from pagedllm.worker.device import num_sms

    bs = 16
    starts, n = [16000, 9000], [1, 1]
    states, num_blocks = case(starts, n, bs, seed=1)
    b = build_batch(states, n, bs, None, build_groups=False, query_tile=ta.query_tile(H // KVH))
    dev = torch.device("cuda")
    assert ta.choose_num_splits(len(b.work), KVH, int(b.seq_lens.max()), num_sms(dev)) > 1
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    kv = torch.randn(2, num_blocks, bs, KVH, D, dtype=torch.bfloat16, device=dev)
    q = torch.randn(2, H, D, dtype=torch.bfloat16, device=dev)
    splits = ta.choose_num_splits(2, KVH, 16001, num_sms(dev))
    out = ta.paged_attention(q, kv, t(b.block_tables), t(b.query_start_loc), t(b.seq_lens), t(b.work), D**-0.5,
                             0, 1, splits)
    torch.testing.assert_close(out.float(), reference(states, n, q, kv, 0, bs), atol=2e-2, rtol=2e-2)


def test_fp8_write_matches_torch_rounding_bit_for_bit() -> None:
    from pagedllm.attention import triton_attention as ta

    torch.manual_seed(0)
    dev = torch.device("cuda")
    kv = torch.zeros(2, 64, 16, KVH, D, dtype=torch.float8_e4m3fn, device=dev)
    k = torch.randn(512, KVH, D, device=dev, dtype=torch.bfloat16) * 50
    v = torch.randn(512, KVH, D, device=dev, dtype=torch.bfloat16) / 100
    slots = torch.randperm(64 * 16, device=dev)[:512]
    # Power-of-2 scales: the division is exact, so the rounding to fp8 alone is compared.
    ta.write_kv(kv, k, v, slots, k_scale=0.25, v_scale=2.0**-7)
    want_k = (k.float() / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_v = (v.float() / 2.0**-7).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(kv[0].reshape(-1, KVH, D)[slots].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(kv[1].reshape(-1, KVH, D)[slots].view(torch.uint8), want_v.view(torch.uint8))


def test_fused_norm_and_rotary_at_8b_sizes_match_the_torch_layers() -> None:
    from transformers import LlamaConfig

    from pagedllm.attention.triton_fused import rms_norm, rotary
    from pagedllm.layers.rmsnorm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    norm = RMSNorm(4096, 1e-5, dt)
    norm.weight.data = torch.randn(4096, dtype=dt)
    x = torch.randn(3000, 4096, dtype=dt)
    ref = norm(x)  # the CPU layer is the reference
    got = rms_norm(x.to(dev), norm.weight.to(dev), 1e-5).cpu()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=H, num_key_value_heads=KVH,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    rope = RotaryEmbedding(cfg, D, 8192, dt)
    q, k = torch.randn(3000, H * D, dtype=dt), torch.randn(3000, KVH * D, dtype=dt)
    pos = torch.randint(0, 8192, (3000,))
    want_q, want_k = rope(pos, q, k)
    got_q, got_k = rotary(pos.to(dev), q.to(dev), k.to(dev), rope.cos.to(dev), rope.sin.to(dev), D)
    torch.testing.assert_close(got_q.cpu(), want_q, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_k.cpu(), want_k, atol=3e-2, rtol=3e-2)
