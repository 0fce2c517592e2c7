"""Long prompt chunks on SmolLM2-135M's attention shape (9 heads, 3 KV heads, head size 64, block
16), in bfloat16 or float32 (queries and cache alike): the native flash kernel (flash_attention.c)
against torch's CPU flash attention over the gathered context (dense_attention_sdpa, the path those
chunks took before), on the chunks of a 7,000-token prompt split at a step budget of CHUNK tokens
(default 7000, what `bench latency --input-len 7000 --max-model-len 8192` runs; 2048 is the
engine's default budget).

With --crossover: chunks of 16..512 tokens after 0..2048 cached ones, the flash kernel against the
paged kernel's prompt path (paged_attention.c, what chunks under FLASH_MIN_TOKENS take) and torch's
flash, to place FLASH_MIN_TOKENS for the dtype.

With --long-context: chunks of 32..1,024 tokens after 3,072..6,144 cached ones, the flash kernel
against torch's flash (where the kernel's AVX2 form leaves large chunks to torch).

Prints ms per call (best of N, the paths' calls interleaved), GFLOP/s (4 * D * visible query-key
pairs * H) and the ratios.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from pagedllm.attention.cpu_kernel import (
    flash_min_tokens, flash_prefill, flash_runs, load_kernel, paged_attention_native,
)
from pagedllm.attention.metadata import DenseAttention
from pagedllm.attention.torch_backend import dense_attention_sdpa
from pagedllm.benchmarks.script import parser

H, KVH, D, BS = 9, 3, 64, 16
PROMPT = 7000


def case(ctx: int, qlen: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    nblk = -(-(ctx + qlen) // BS)
    kv = torch.randn(2, nblk + 8, BS, KVH, D, generator=g).to(dtype)
    blocks = torch.randperm(nblk + 8, generator=g)[:nblk].contiguous()
    q = torch.randn(qlen, H, D, generator=g).to(dtype)
    return q, kv, DenseAttention(0, qlen, blocks, ctx + qlen)


def best_of(fns: list[Callable[[], object]], n: int) -> list[float]:
    """Best seconds per call of each function, calls interleaved (a loaded machine slows all alike)."""
    best = [float("inf")] * len(fns)
    for _ in range(n):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def flops(ctx: int, qlen: int) -> float:
    return 4 * D * H * qlen * (ctx + (qlen + 1) / 2)


def prompt_chunks(chunk: int, dtype: torch.dtype) -> None:
    scale = D**-0.5
    print(f"{'chunk':>18} {'native ms':>10} {'torch ms':>10} {'native GF/s':>12} {'torch GF/s':>11} "
          f"{'torch/native':>13}")
    tot = [0.0, 0.0]
    for ctx in range(0, PROMPT, chunk):
        qlen = min(chunk, PROMPT - ctx)
        q, kv, d = case(ctx, qlen, dtype)
        best = best_of([lambda: flash_prefill(q, kv, d.blocks, 0, qlen, d.seq_len, scale),
                        lambda: dense_attention_sdpa(q, kv, d, scale, 1.0, 1.0)], 3)
        tot = [t + b for t, b in zip(tot, best)]
        f = flops(ctx, qlen)
        print(f"{f'{qlen} after {ctx}':>18} {best[0] * 1e3:10.1f} {best[1] * 1e3:10.1f} {f / best[0] / 1e9:12.1f} "
              f"{f / best[1] / 1e9:11.1f} {best[1] / best[0]:13.2f}")
    print(f"one layer, whole prompt: native {tot[0] * 1e3:.0f} ms, torch {tot[1] * 1e3:.0f} ms, "
          f"torch/native {tot[1] / tot[0]:.2f}")


def crossover(dtype: torch.dtype) -> None:
    paged = load_kernel()
    if paged is None:
        sys.exit("the paged attention kernel is not available here")
    scale = D**-0.5
    print(f"flash_min_tokens({dtype}) = {flash_min_tokens(dtype)}")
    print(f"{'chunk':>16} {'flash ms':>9} {'paged ms':>9} {'torch ms':>9} {'paged/flash':>12} {'torch/flash':>12}")
    for ctx in (0, 256, 2048):
        for qlen in (16, 32, 48, 64, 96, 128, 256, 512):
            q, kv, d = case(ctx, qlen, dtype)
            bt = d.blocks[None]
            qsl = torch.tensor([0, qlen], dtype=torch.int64)
            seq = torch.tensor([ctx + qlen], dtype=torch.int64)
            work = torch.tensor([[0, t0, min(8, qlen - t0)] for t0 in range(0, qlen, 8)], dtype=torch.int64)
            n = max(3, min(50, int(2e8 / flops(ctx, qlen))))
            best = best_of([lambda: flash_prefill(q, kv, d.blocks, 0, qlen, d.seq_len, scale),
                            lambda: paged_attention_native(paged, q, kv, bt, qsl, seq, work, scale, 0),
                            lambda: dense_attention_sdpa(q, kv, d, scale, 1.0, 1.0)], n)
            print(f"{f'{qlen} after {ctx}':>16} {best[0] * 1e3:9.2f} {best[1] * 1e3:9.2f} {best[2] * 1e3:9.2f} "
                  f"{best[1] / best[0]:12.2f} {best[2] / best[0]:12.2f}")


def long_context(dtype: torch.dtype) -> None:
    """Chunks of 32..1,024 tokens after 3,072..6,144 cached ones, the flash kernel against torch's
    flash: where FLASH_AVX2_MAX_PAIRS leaves chunks to torch on the kernel's AVX2 form."""
    scale = D**-0.5
    print(f"{'chunk':>16} {'flash ms':>9} {'torch ms':>9} {'torch/flash':>12}")
    for ctx in (3072, 4096, 6144):
        for qlen in (32, 128, 512, 1024):
            q, kv, d = case(ctx, qlen, dtype)
            n = max(3, min(20, int(2e8 / flops(ctx, qlen))))
            best = best_of([lambda: flash_prefill(q, kv, d.blocks, 0, qlen, d.seq_len, scale),
                            lambda: dense_attention_sdpa(q, kv, d, scale, 1.0, 1.0)], n)
            print(f"{f'{qlen} after {ctx}':>16} {best[0] * 1e3:9.2f} {best[1] * 1e3:9.2f} {best[1] / best[0]:12.2f}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("threads", type=int, nargs="?", help="torch threads (default: torch's)")
    ap.add_argument("chunk", type=int, nargs="?", default=PROMPT, help=f"step budget in tokens (default {PROMPT})")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--crossover", action="store_true", help="short chunks: flash against the paged kernel")
    ap.add_argument("--long-context", action="store_true", help="chunks after 3,072..6,144 cached tokens")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not flash_runs(dtype, dtype, D):
        sys.exit(f"the native flash kernel does not run {args.dtype} here (needs AVX-512 or AVX2 + FMA, and AVX-512 BF16 for bfloat16)")
    print(f"H {H}, KVH {KVH}, D {D}, block {BS}, {args.dtype}, {torch.get_num_threads()} threads")
    if args.crossover:
        crossover(dtype)
    elif args.long_context:
        long_context(dtype)
    else:
        prompt_chunks(args.chunk, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
