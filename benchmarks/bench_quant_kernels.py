"""Micro-benchmark of the candidate kernels for quantized linear layers (docs/quantization.md).

One SmolLM2 MLP matrix (gate_up: 3072 x 576) at decode (1 token) and prefill (256 tokens) shapes;
the float matmul runs in the same process, and every time is reported as a ratio to it.
Run: flock /tmp/pagedllm-bench.lock python benchmarks/bench_quant_kernels.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pagedllm.quantization import kernels as K
from pagedllm.quantization import native


def best(fn, reps: int = 20) -> float:
    fn()
    t = float("inf")
    for _ in range(reps):
        s = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - s)
    return t


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    n, k = 3072, 576
    w = torch.randn(n, k) * 0.05
    q8, s8 = K.quantize_int8_per_channel(w)
    q8t = q8.t().contiguous()
    codes, sc, zp = K.quantize_groupwise(w, 64, 4)
    p4, sz32 = K.pack_int4(codes, sc, zp, torch.float32)
    _, sz16 = K.pack_int4(codes, sc, zp, torch.bfloat16)
    n4, ns, nz = native.pack_int4_native(codes, sc, zp)
    s8b, z8 = s8.bfloat16(), torch.zeros(n, 1, dtype=torch.bfloat16)
    reps = {1: 20, 4: 20, 256: 3}
    f8, s_f8 = K.quantize_fp8_per_channel(w)
    f8s = s_f8.bfloat16()[:, None]
    qg = (codes.to(torch.int16) - 0).to(torch.int8)
    wb = w.bfloat16()
    for m in (1, 4, 256):
        x = torch.randn(m, k)
        xb = x.bfloat16()
        best_m = lambda fn: best(fn, reps[m])  # noqa: E731
        base = best_m(lambda: F.linear(x, w))
        rows = {
            "fp32 F.linear": base,
            "bf16 F.linear": best_m(lambda: F.linear(xb, wb)),
            "int8 _weight_int8pack_mm (fp32 x)": best_m(lambda: torch._weight_int8pack_mm(x, q8, s8)),
            "int8 _weight_int8pack_mm (bf16 x)": best_m(lambda: K.int8_weight_linear(xb, q8, s8.bfloat16())),
            "int8 dequantize + F.linear (unfused)": best_m(lambda: F.linear(x, q8.float() * s8[:, None])),
            "w8a8 quantize x + torch._int_mm": best_m(lambda: K.int8_dynamic_linear(x, q8t, s8)),
            "int4 _weight_int4pack_mm_for_cpu (fp32 x)": best_m(lambda: K.int4_linear(x, p4, sz32, 64)),
            "int4 _weight_int4pack_mm_for_cpu (bf16 x)": best_m(lambda: K.int4_linear(xb, p4, sz16, 64)),
            "int4 native (csrc/linear_quant.c), bf16 x": best_m(lambda: native.group_linear(xb, n4, ns, nz, 4)),
            "int8 native (csrc/linear_quant.c), bf16 x": best_m(
                lambda: native.group_linear(xb, q8, s8b[:, None], z8, 8)),
            "fp8 native (csrc/linear_quant.c), bf16 x": best_m(
                lambda: native.group_linear(xb, f8.view(torch.uint8), f8s, z8, 3)),
            "fp8 widen + F.linear": best_m(lambda: K.fp8_weight_linear(x, f8, s_f8)),
            "int8 codes, group scales, widen + F.linear": best(
                lambda: K.int8_group_linear(x, qg, sc, zp)),
        }
        print(f"\ntokens={m}  (fp32 F.linear {base * 1e6:.0f} us = 1.00)")
        for name, t in rows.items():
            print(f"  {name:45s} {t * 1e6:9.0f} us  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
