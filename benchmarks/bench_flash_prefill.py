"""Long prompt chunks in bfloat16 on SmolLM2-135M's attention shape (9 heads, 3 KV heads, head size
64, block 16): the native flash kernel (flash_attention.c) against torch's CPU flash attention over
the gathered context (dense_attention_sdpa, the path bf16 took before), on the chunks of a 7,000-token
prompt split at a step budget of CHUNK tokens (default 7000, what `bench latency --input-len 7000
--max-model-len 8192` runs; 2048 is the engine's default budget).

Usage: PYTHONPATH=. .venv/bin/python benchmarks/bench_flash_prefill.py [THREADS] [CHUNK]
Prints ms per call (best of N, the two paths' calls interleaved), GFLOP/s (4 * D * visible
query-key pairs * H) and the ratio torch / native.
"""
from __future__ import annotations

import sys
import time

import torch

from pagedllm.attention.cpu_kernel import flash_prefill, load_flash
from pagedllm.attention.metadata import DenseAttention
from pagedllm.attention.torch_backend import dense_attention_sdpa

H, KVH, D, BS = 9, 3, 64, 16
PROMPT = 7000


def case(ctx: int, qlen: int):
    g = torch.Generator().manual_seed(0)
    nblk = -(-(ctx + qlen) // BS)
    kv = torch.randn(2, nblk + 8, BS, KVH, D, generator=g).to(torch.bfloat16)
    blocks = torch.randperm(nblk + 8, generator=g)[:nblk].contiguous()
    q = torch.randn(qlen, H, D, generator=g).to(torch.bfloat16)
    return q, kv, DenseAttention(0, qlen, blocks, ctx + qlen, None)


def main() -> None:
    torch.set_grad_enabled(False)
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    chunk = int(sys.argv[2]) if len(sys.argv) > 2 else PROMPT
    if load_flash() is None:
        sys.exit("the native flash kernel is not available here (needs AVX-512 BF16)")
    scale = D**-0.5
    print(f"H {H}, KVH {KVH}, D {D}, block {BS}, bfloat16, {torch.get_num_threads()} threads")
    print(f"{'chunk':>18} {'native ms':>10} {'torch ms':>10} {'native GF/s':>12} {'torch GF/s':>11} {'torch/native':>13}")
    tot = [0.0, 0.0]
    for ctx in range(0, PROMPT, chunk):
        qlen = min(chunk, PROMPT - ctx)
        q, kv, d = case(ctx, qlen)
        fns = [lambda: flash_prefill(q, kv, d.blocks, 0, qlen, d.seq_len, scale),
               lambda: dense_attention_sdpa(q, kv, d, scale, 1.0, 1.0)]
        best = [float("inf")] * 2
        for _ in range(3):
            for i, f in enumerate(fns):
                t0 = time.perf_counter()
                f()
                best[i] = min(best[i], time.perf_counter() - t0)
        flops = 4 * D * H * qlen * (ctx + (qlen + 1) / 2)
        tot = [t + b for t, b in zip(tot, best)]
        print(f"{f'{qlen} after {ctx}':>18} {best[0] * 1e3:10.1f} {best[1] * 1e3:10.1f} {flops / best[0] / 1e9:12.1f} "
              f"{flops / best[1] / 1e9:11.1f} {best[1] / best[0]:13.2f}")
    print(f"one layer, whole prompt: native {tot[0] * 1e3:.0f} ms, torch {tot[1] * 1e3:.0f} ms, "
          f"torch/native {tot[1] / tot[0]:.2f}")


if __name__ == "__main__":
    main()
