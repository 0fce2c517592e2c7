"""The native paged attention kernel on SmolLM2-135M's attention shape (9 heads, 3 KV heads, head
size 64, block 16): decode batches and prompt chunks, per cache dtype, against a baseline build of
the kernel (another version of paged_attention.c, e.g. `git show main:pagedllm/native/csrc/
paged_attention.c > /tmp/base.c`).

Prints ms per call (best of N, the two builds' calls interleaved) and the ratio baseline / current.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from pagedllm import native
from pagedllm.attention.cpu_kernel import load_kernel, paged_attention_native
from pagedllm.benchmarks.script import parser
from pagedllm.native import kernels

H, KVH, D, BS = 9, 3, 64, 16


def case(num_req: int, ctx: int, qlen: int, dtype: torch.dtype, kv_dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    nblk = -(-(ctx + qlen) // BS)
    num_blocks = num_req * nblk
    kv = torch.randn(2, num_blocks, BS, KVH, D, generator=g).to(kv_dtype)
    bt = torch.randperm(num_blocks, generator=g).view(num_req, nblk).contiguous()
    qsl = torch.arange(num_req + 1, dtype=torch.int64) * qlen
    seq = torch.full((num_req,), ctx + qlen, dtype=torch.int64)
    work = torch.tensor([[r, t0, min(8, qlen - t0)] for r in range(num_req) for t0 in range(0, qlen, 8)],
                        dtype=torch.int64)
    q = torch.randn(num_req * qlen, H, D, generator=g).to(dtype)
    return q, kv, bt, qsl, seq, work


def timeit(libs, args, n: int) -> list[float]:
    """Best ms per call of each library, calls interleaved (a loaded machine slows both alike)."""
    best = [float("inf")] * len(libs)
    for _ in range(n):
        for i, lib in enumerate(libs):
            t0 = time.perf_counter()
            paged_attention_native(lib, *args, D**-0.5, 0)
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("baseline", nargs="?", help="another paged_attention.c to time against the current kernel")
    ap.add_argument("threads", type=int, nargs="?", help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    cur = load_kernel()
    base = None
    if args.baseline:
        # Compiled under its own name next to the current kernel (compile_native caches by content).
        tmp = native.CSRC / "_baseline_paged_attention.c"
        tmp.write_text(Path(args.baseline).read_text())
        try:
            base = native.bind(native.compile_native(tmp), kernels.ATTENTION)
        finally:
            tmp.unlink()
    cases = [("128 decodes, 300 keys", 128, 300, 1), ("64 decodes, 1000 keys", 64, 1000, 1),
             ("1 decode, 400 keys", 1, 400, 1), ("64-token chunk after 256", 1, 256, 64)]
    dts = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
           (torch.bfloat16, torch.float8_e4m3fn)]
    print("| case | q / cache | baseline ms | current ms | speed-up |\n|---|---|---|---|---|")
    for name, nr, ctx, ql in cases:
        for dt, kvdt in dts:
            args = case(nr, ctx, ql, dt, kvdt)
            ref = paged_attention_native(cur, *args, D**-0.5, 0)
            n = 10 if nr > 1 else 200
            if base is not None:
                c, b = timeit([cur, base], args, n)
                out_b = paged_attention_native(base, *args, D**-0.5, 0)
                err = (out_b.float() - ref.float()).abs().max().item()
                print(f"| {name} | {str(dt)[6:]} / {str(kvdt)[6:]} | {b:.3f} | {c:.3f} | {b / c:.2f}x | (max diff {err:.1e})")
            else:
                (c,) = timeit([cur], args, n)
                print(f"| {name} | {str(dt)[6:]} / {str(kvdt)[6:]} | | {c:.3f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
