"""Micro-benchmark of the candidate kernels for quantized linear layers (docs/quantization.md).

One SmolLM2 MLP matrix (gate_up: 3072 x 576) at decode (1 token) and prefill (256 tokens) shapes;
the float matmul runs in the same process, and every time is reported as a ratio to it.

``--decode-pass``: the native kernel over the linear layers of a SmolLM2 decode step (30 layers
of distinct 4-bit g32 weights per shape, 33 MB for gate_up: about the L3 cache), one token,
per layer shape, on one thread and on two (``quant_set_parallel_min``), both activation modes;
this sets the kernel's threading threshold.

``--w8a8``: w8a8's layouts per SmolLM2 layer shape, two threads: one token (30 distinct weights per
shape) through the native kernel on the row-major codes, through the torch path (per-token
quantization + ``torch._int_mm``), and the int8 method's tiled kernel; 256 tokens through the torch
path on the transposed copy [K, N] and on the transpose view of the row-major codes, and the cost
of re-laying the codes out once (a transposed copy), which a single layout would pay per call;
then per number of rows (1 to 64, 30 distinct weights) the w8a8 call as dispatched (AMX tiles
from w8a8_amx_rows() rows where the CPU has AMX-INT8, else the vpdpbusd batch form from
w8a8_vnni_rows() rows), its vpdpbusd batch form, its row form, and the AVX2 form's batch path
(``torch._int_mm`` between the kernel's passes).
``--int8-peak``: how close w8a8's batches run to this CPU's int8 rate, two threads. The peak: the
kernels' own int8 product on registers only (``int8_dot_peak``: vpdpbusd on AVX-512 VNNI, the AVX2
form's vpmaddubsw pairs elsewhere), beside the bf16 GEMM peak (``env.measure_matmul_peak``). Then
per SmolLM2 layer shape and number of rows (16 to 1,024, the batches of the 128-request workload):
w8a8's call as dispatched (``native.w8a8_linear``: the AMX tiles or the vpdpbusd batch form
where the kernel has one) in GOP/s and as a fraction of the int8 peak (measured again right
after the row's timings), ``torch._int_mm`` alone
and with the kernel's two passes around it (``native.w8a8_batch_linear``, the AVX2 form's batch
path), the unfused int8 path (the weight widened to bf16 on every call, then ``F.linear``) and its
bf16 GEMM alone; the last column is the unfused call's time over w8a8's. ``--output-json`` writes
the figures with the run's record.
Run: flock /tmp/pagedllm-bench.lock pagedllm bench kernels quant [--decode-pass | --w8a8 | --int8-peak]
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.quantization import kernels as K
from pagedllm.quantization import native
from pagedllm.benchmarks import env
from pagedllm.benchmarks.script import parser


def best(fn, reps: int = 20) -> float:
    fn()
    t = float("inf")
    for _ in range(reps):
        s = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - s)
    return t


def kernel_table() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    n, k = 3072, 576
    w = torch.randn(n, k) * 0.05
    q8, s8 = K.quantize_int8_per_channel(w)
    q8t = q8.t().contiguous()
    w8sum = q8.sum(dim=1, dtype=torch.int32)
    codes, sc, zp = K.quantize_groupwise(w, 64, 4)
    p4, sz32 = K.pack_int4(codes, sc, zp, torch.float32)
    _, sz16 = K.pack_int4(codes, sc, zp, torch.bfloat16)
    n4, ns, nz = native.pack_int4_native(codes, sc, zp)
    n8, n8s, n8z = native.pack_int8_native(q8, s8[:, None], torch.zeros(n, 1))
    z8 = torch.zeros(n, 1, dtype=torch.bfloat16)
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
            "w8a8 native (row-major codes; <= 16 tokens)": best_m(
                lambda: native.w8a8_small_m_linear(x, q8, s8, w8sum)) if m <= native.SMALL_M else float("nan"),
            "int4 _weight_int4pack_mm_for_cpu (fp32 x)": best_m(lambda: K.int4_linear(x, p4, sz32, 64)),
            "int4 _weight_int4pack_mm_for_cpu (bf16 x)": best_m(lambda: K.int4_linear(xb, p4, sz16, 64)),
            **{f"int4 native (csrc/linear_quant.c), {a} x": best_m(
                lambda: _mode(a, lambda: native.group_linear(xb, n4, ns, nz, 4, n))) for a in ("int8", "bf16")},
            **{f"int8 native (csrc/linear_quant.c), {a} x": best_m(
                lambda: _mode(a, lambda: native.group_linear(xb, n8, n8s, n8z, 8, n))) for a in ("int8", "bf16")},
            "fp8 native (csrc/linear_quant.c), bf16 x": best_m(
                lambda: native.group_linear(xb, f8.view(torch.uint8), f8s, z8, 3, n)),
            "fp8 widen + F.linear": best_m(lambda: K.fp8_weight_linear(x, f8, s_f8)),
            "int8 codes, group scales, widen + F.linear": best(
                lambda: K.int8_group_linear(x, qg, sc, zp)),
        }
        print(f"\ntokens={m}  (fp32 F.linear {base * 1e6:.0f} us = 1.00)")
        for name, t in rows.items():
            print(f"  {name:45s} {t * 1e6:9.0f} us  {t / base:6.2f}x")


def _mode(act: str, fn):
    """fn() with the kernel's activations in `act` (int8 or bf16)."""
    os.environ["PAGEDLLM_QUANT_ACTIVATIONS"] = act
    native.int8_activations.cache_clear()
    return fn()


def decode_pass(reps: int = 15) -> None:
    torch.manual_seed(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    layers = {name: [native.pack_int4_native(*K.quantize_groupwise(torch.randn(n, k) * 0.05, 32, 4))
                     for _ in range(30)] for name, (n, k) in shapes.items()}
    lib = native.load_quant_kernel()
    for act in ("int8", "bf16"):
        _mode(act, lambda: None)
        for threads, label in ((1, "1 thread"), (2, "2 threads")):
            torch.set_num_threads(threads)
            default = lib.quant_set_parallel_min(0 if threads == 2 else 1 << 62)
            times = {}
            for name, (n, k) in shapes.items():
                x = torch.randn(1, k).bfloat16()

                def run() -> None:
                    for packed, s, z in layers[name]:
                        native.small_m_linear(x, packed, s, z, 4, n)

                times[name] = best(run, reps) / 30
            total = sum(times.values()) * 30
            print(f"{act} activations, {label}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in times.items())
                  + f"; 30 layers {total * 1e3:.2f} ms", flush=True)
            lib.quant_set_parallel_min(default)


def w8a8(reps: int = 15) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    for name, (n, k) in shapes.items():
        layers = []
        for _ in range(30):
            q, s = K.quantize_int8_per_channel(torch.randn(n, k) * 0.05)
            layers.append((q, s, q.sum(dim=1, dtype=torch.int32), native.pack_int8_native(q, s[:, None],
                                                                                          torch.zeros(n, 1))))
        x1 = torch.randn(1, k).bfloat16()

        def per_layer(fn) -> float:
            return best(lambda: [fn(*lay) for lay in layers], reps) / 30

        one = {
            "native w8a8 (row-major codes)": per_layer(lambda q, s, ws, t: native.w8a8_small_m_linear(x1, q, s, ws)),
            "torch w8a8 (_int_mm)": per_layer(lambda q, s, ws, t: K.int8_dynamic_linear(x1, q.t(), s)),
            "native int8 (tiled codes)": per_layer(lambda q, s, ws, t: native.small_m_linear(x1, *t, 8, n)),
        }
        q, s, _, _ = layers[0]
        qt = q.t().contiguous()
        x256 = torch.randn(256, k).bfloat16()
        batch = {
            "_int_mm on [K, N] copy": best(lambda: K.int8_dynamic_linear(x256, qt, s), 5),
            "_int_mm on [N, K].t() view": best(lambda: K.int8_dynamic_linear(x256, q.t(), s), 5),
            "re-layout copy of the codes": best(lambda: q.t().contiguous(), 5),
        }
        print(f"{name} {n}x{k}: 1 token: " + ", ".join(f"{a} {t * 1e6:.1f} us" for a, t in one.items())
              + "; 256 tokens: " + ", ".join(f"{a} {t * 1e6:.0f} us" for a, t in batch.items()), flush=True)
        print(f"{name} {n}x{k} rows: " + "; ".join(_w8a8_forms(layers, per_layer, k)), flush=True)


def _w8a8_forms(layers, per_layer, k: int) -> list[str]:
    """Per number of rows (30 distinct weights): w8a8_linear as dispatched (AMX tiles from
    w8a8_amx_rows() rows where there are any, else the vpdpbusd batch form from w8a8_vnni_rows()),
    its vpdpbusd batch form, its row form, and the batch path of the AVX2 form
    (native.w8a8_batch_linear: torch._int_mm between the kernel's passes)."""
    lib = native.load_quant_kernel()
    amx, vnni_from = lib.w8a8_amx_rows(), lib.w8a8_vnni_rows()
    out = []
    for m in (1, 2, 4, 5, 8, 16, 32, 64):
        x = torch.randn(m, k).bfloat16()

        def kernel(amx_from: int, batch_from: int) -> float:
            lib.w8a8_amx_from(amx_from)
            lib.w8a8_vnni_from(batch_from)
            try:
                return per_layer(lambda q, s, ws, t: native.w8a8_small_m_linear(x, q, s, ws)) \
                    if m <= native.w8a8_rows() else float("nan")
            finally:
                lib.w8a8_amx_from(amx)
                lib.w8a8_vnni_from(vnni_from)

        call = per_layer(lambda q, s, ws, t: native.w8a8_linear(x, q, s, ws))
        vnni = kernel(1 << 62, 1) if vnni_from else float("nan")
        rows = kernel(1 << 62, 1 << 62)
        batch = per_layer(lambda q, s, ws, t: native.w8a8_batch_linear(x, q, s))
        form = ("tiles" if amx and m >= amx else "vpdpbusd blocks" if vnni_from and m >= vnni_from
                else "row form" if m <= native.w8a8_rows() else "_int_mm")
        out.append(f"{m}: {call * 1e6:.1f} us ({form}), vpdpbusd blocks {vnni * 1e6:.1f}, row form {rows * 1e6:.1f}, "
                   f"_int_mm {batch * 1e6:.1f}")
    return out


def int8_peak_ops(iters: int = 20_000_000, reps: int = 5) -> float:
    """Int8 ops per second (2 per multiply-add) of the kernels' own product on registers, all of
    OpenMP's threads: the median of `reps` timed calls of ``int8_dot_peak``."""
    lib = native.load_quant_kernel()
    rates = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        n = lib.int8_dot_peak(iters)
        rates.append(2 * n / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


def int8_peak(output_json: str | None = None) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    peak = first_peak = int8_peak_ops()
    bf16_peak = env.measure_matmul_peak(dtype="bfloat16")
    # the build's form: only the AVX-512 one (vpdpbusd) has the w8a8 batch form
    product = "vpdpbusd (AVX-512 VNNI)" if native.load_quant_kernel().w8a8_vnni_rows() else \
        "vpmaddubsw + vpmaddwd (AVX2)"
    print(f"int8 peak, {product} on registers, 2 threads: {peak / 1e9:.0f} GOP/s; "
          f"bf16 GEMM peak (1024^3): {bf16_peak / 1e9:.0f} GFLOP/s", flush=True)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    rows = []
    for name, (n, k) in shapes.items():
        q, s = K.quantize_int8_per_channel(torch.randn(n, k) * 0.05)
        ws = q.sum(dim=1, dtype=torch.int32)
        wb = (q.float() * s[:, None]).bfloat16()
        for m in (16, 64, 128, 256, 512, 1024):
            x = torch.randn(m, k).bfloat16()
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            reps = 15 if m <= 256 else 7

            def med(fn) -> float:
                return statistics.median(env.call_times(fn, reps))

            t_call, t_mm = med(lambda: native.w8a8_linear(x, q, s, ws)), med(lambda: torch._int_mm(xq, q.t()))
            t_mm_path = med(lambda: native.w8a8_batch_linear(x, q, s))
            t_unfused, t_bf16 = med(lambda: K.int8_dequant_linear(x, q, s)), med(lambda: F.linear(x, wb))
            ops = 2 * m * n * k
            peak = int8_peak_ops(10_000_000, 3)  # again beside each row: this CPU's rate moves between minutes
            row = {"layer": name, "n": n, "k": k, "rows": m, "int8_peak_gops": peak / 1e9, "w8a8_call_us": t_call * 1e6,
                   "w8a8_call_gops": ops / t_call / 1e9, "w8a8_call_fraction_of_peak": ops / t_call / peak,
                   "int_mm_us": t_mm * 1e6, "int_mm_gops": ops / t_mm / 1e9, "int_mm_fraction_of_peak": ops / t_mm / peak,
                   "int_mm_path_us": t_mm_path * 1e6, "unfused_call_us": t_unfused * 1e6, "bf16_gemm_us": t_bf16 * 1e6,
                   "bf16_gemm_gflops": ops / t_bf16 / 1e9, "unfused_over_w8a8": t_unfused / t_call}
            rows.append(row)
            print(f"{name} {n}x{k}, {m} rows: w8a8 call {t_call * 1e6:.0f} us ({row['w8a8_call_gops']:.0f} GOP/s, "
                  f"{100 * row['w8a8_call_fraction_of_peak']:.0f}% of the int8 peak, {peak / 1e9:.0f} beside it); _int_mm {t_mm * 1e6:.0f} us "
                  f"({100 * row['int_mm_fraction_of_peak']:.0f}%), with the passes {t_mm_path * 1e6:.0f} us; "
                  f"unfused int8 call {t_unfused * 1e6:.0f} us (its bf16 GEMM {t_bf16 * 1e6:.0f} us, "
                  f"{row['bf16_gemm_gflops']:.0f} GFLOP/s); unfused / w8a8 {row['unfused_over_w8a8']:.2f}x", flush=True)
    if output_json:
        out = {"meta": env.run_metadata(), "int8_peak_gops": first_peak / 1e9, "int8_product": product,
               "bf16_gemm_peak_gflops": bf16_peak / 1e9, "rows": rows}
        Path(output_json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--decode-pass", action="store_true")
    ap.add_argument("--w8a8", action="store_true")
    ap.add_argument("--int8-peak", action="store_true")
    ap.add_argument("--output-json", default=None, help="with --int8-peak: write its figures and the run's record here")
    args = ap.parse_args(argv)
    if args.decode_pass:
        decode_pass()
    elif args.w8a8:
        w8a8()
    elif args.int8_peak:
        int8_peak(args.output_json)
    else:
        kernel_table()


if __name__ == "__main__":
    raise SystemExit(main())
