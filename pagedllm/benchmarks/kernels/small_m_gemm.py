"""The small-M GEMM kernel (pagedllm/native/csrc/small_m_gemm.c) against torch's GEMM, by rows.

Usage: .venv/bin/pagedllm bench kernels small-m-gemm [--dtype bfloat16] [--rows 1,4,8,16,32,48,64]

The four linear layers of the default model's shapes (qkv 576->960, o 576->576, gate|up 576->3072,
down 1536->576), 30 layers of random weights (212 MB in bf16), so that each pass streams its weights
from memory as a decode step does. Per row count: the median of 7 passes over all 30 layers through
the kernel and through torch (`dense_linear`'s choice without the kernel: oneDNN or MKL), and the
ratio. This is what sets the row limits in pagedllm/layers/native_linear.py. On CPUs without bf16
dot products, torch's bf16 GEMM here is layers/linear.py's: operands widened to float32 for
oneDNN's float32 GEMM.
"""

from __future__ import annotations

import statistics

import torch

from pagedllm.benchmarks.env import call_times
from pagedllm.layers.linear import torch_linear
from pagedllm.layers.native_linear import _DTYPE_CODES, load_linear_kernel
from pagedllm.benchmarks.script import parser

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N)
LAYERS = 30


def _median_s(fn, reps: int = 7) -> float:
    return statistics.median(call_times(fn, reps))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", default="1,4,8,16,32,48,64")
    a = ap.parse_args(argv)
    dt = getattr(torch, a.dtype)
    lib = load_linear_kernel()
    if lib is None:
        raise SystemExit("the small-M kernel does not run here (neither AVX-512 nor AVX2 with FMA)")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).to(dt) for k, n in SHAPES] for _ in range(LAYERS)]
    flops_per_row = 2 * LAYERS * sum(k * n for k, n in SHAPES)
    print(f"{a.dtype}, {torch.get_num_threads()} threads, {LAYERS} layers of {SHAPES} (K, N)")
    print("| rows | kernel ms | GFLOP/s | torch ms | GFLOP/s | kernel speed-up |\n|---|---|---|---|---|---|")
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k).to(dt) for k, _ in SHAPES}
        ys = {n: torch.empty(m, n, dtype=dt) for _, n in SHAPES}

        def kernel() -> None:
            for layer in weights:
                for (k, n), w in zip(SHAPES, layer):
                    lib.small_m_linear(xs[k].data_ptr(), m, w.data_ptr(), None, n, k, ys[n].data_ptr(), _DTYPE_CODES[dt])

        def torch_gemm() -> None:
            for layer in weights:
                for (k, _), w in zip(SHAPES, layer):
                    torch_linear(xs[k], w)

        with torch.inference_mode():
            tk, tt = _median_s(kernel), _median_s(torch_gemm)
        gf = flops_per_row * m / 1e9
        print(f"| {m} | {1e3 * tk:.2f} | {gf / tk:.0f} | {1e3 * tt:.2f} | {gf / tt:.0f} | {tt / tk:.2f}x |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
