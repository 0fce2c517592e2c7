"""The quantized embedding's lookup (native.gather_rows: only the looked-up rows expanded from the
codes) against the dense lookup (F.embedding on the bfloat16 / float32 weight) and against
expanding the whole matrix (native.dequantize), on the default model's shape (49152 x 576).

Run: flock /tmp/pagedllm-bench.lock pagedllm bench kernels embedding-gather [--rows 1,16,512,2048]
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from pagedllm.benchmarks.env import call_times
from pagedllm.quantization import native
from pagedllm.quantization.vocab import quantize_rows
from pagedllm.benchmarks.script import parser


def best_us(fn, reps: int) -> float:
    return min(call_times(fn, reps)) * 1e6


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--rows", default="1,16,512,2048")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    vocab, hidden = 49152, 576
    w = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.05
    codes = {s: quantize_rows(w, s, 128) for s in ("int8", "int4", "fp8")}
    print(f"{'rows':>6} {'dtype':>9} {'dense':>9} " + " ".join(f"{s + ' rows':>11}" for s in codes)
          + f" {'int4 whole':>11}  (best of {args.reps}, microseconds)")
    for m in map(int, args.rows.split(",")):
        ids = torch.randint(0, vocab, (m,), generator=torch.Generator().manual_seed(m))
        for dtype in (torch.bfloat16, torch.float32):
            dense = w.to(dtype)
            cells = [best_us(lambda: F.embedding(ids, dense), args.reps)]
            for rc in codes.values():
                cells.append(best_us(lambda rc=rc: native.gather_rows(*rc.tensors(), rc.bits, vocab, ids, dtype),
                                     args.reps))
            rc = codes["int4"]
            whole = best_us(lambda: native.dequantize(*rc.tensors(), rc.bits, vocab, dtype)[ids], 3)
            print(f"{m:>6} {str(dtype).removeprefix('torch.'):>9} " + " ".join(f"{c:>9.1f}" for c in cells[:1])
                  + " " + " ".join(f"{c:>11.1f}" for c in cells[1:]) + f" {whole:>11.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
