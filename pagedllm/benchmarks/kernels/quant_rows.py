"""Where the native quantized kernels stop beating the batch path: per layer shape and number of
rows, the kernel call (4-bit tiles, int8 tiles, e4m3 bytes, w8a8's row-major codes) against the
batch path (the weight expanded by native.dequantize, then F.linear; w8a8: native.w8a8_batch_linear),
and the float32 GEMM on the float weight. Sets native.SMALL_M / E4M3_ROWS (docs: benchmarks/results/avx2.md).

    pagedllm bench kernels quant-rows [--threads 2] [--rows 16,32,64,128,256]

Prints one line per (shape, rows): "bits:kernel_ms/batch_ms" for each kind, and the float32 GEMM;
where w8a8_linear runs on AMX tiles, also "w8a8-vnni:ms", the same call in its vpdpbusd batch form;
where it has that batch form, also "w8a8-rows:ms", the same call in its row form.
"""

from __future__ import annotations

import time

import torch

from pagedllm.quantization import kernels as K
from pagedllm.quantization import native
from pagedllm.benchmarks.script import parser


def _ms(f, n: int = 10) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,32,64,128,256")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = native.load_quant_kernel()
    if lib is None:
        raise SystemExit("the native quantized kernel does not run on this CPU")
    amx = lib.w8a8_amx_rows()  # rows from which w8a8_linear takes AMX tiles (0: never)
    kernels = {4: lib.int4_linear_bf16, 8: lib.int8_linear_bf16, 3: lib.e4m3_linear_bf16}
    for n, k in ((3072, 576), (576, 1536)):  # SmolLM2's gate_up and down projections
        w = torch.randn(n, k) * 0.05
        codes4, s4, z4 = K.quantize_groupwise(w, 32, 4)
        codes8, s8 = K.quantize_int8_per_channel(w)
        w8, s3 = K.quantize_fp8_per_channel(w)
        layouts = {4: native.pack_int4_native(codes4, s4, z4),
                   8: native.pack_int8_native(codes8, s8[:, None], torch.zeros(n, 1)),
                   3: (w8.view(torch.uint8), s3.bfloat16()[:, None], torch.zeros(n, 1, dtype=torch.bfloat16))}
        wsum = codes8.sum(1, dtype=torch.int32)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            y = torch.empty(m, n)
            row = [f"{n}x{k}", f"rows {m}"]
            for bits, (c, s, z) in layouts.items():
                g = k // s.shape[1]
                kern = _ms(lambda: kernels[bits](xb.data_ptr(), m, c.data_ptr(), s.data_ptr(), z.data_ptr(), n, k, g,
                                                 y.data_ptr(), 1, 1))
                batch = _ms(lambda: torch.nn.functional.linear(x, native.dequantize(c, s, z, bits, n, torch.float32)))
                row.append(f"{bits}:{kern:.2f}/{batch:.2f}")

            def w8a8() -> int:
                return lib.w8a8_linear(x.data_ptr(), m, codes8.data_ptr(), s8.data_ptr(), wsum.data_ptr(), n, k,
                                       y.data_ptr(), 1)

            row.append(f"w8a8:{_ms(w8a8):.3f}/{_ms(lambda: native.w8a8_batch_linear(x, codes8, s8)):.3f}")
            if amx:  # the same call in the vpdpbusd batch form
                lib.w8a8_amx_from(1 << 62)
                row.append(f"w8a8-vnni:{_ms(w8a8):.3f}")
                lib.w8a8_amx_from(amx)
            if lib.w8a8_vnni_rows():  # and in the row form
                vnni_from = lib.w8a8_vnni_rows()
                lib.w8a8_amx_from(1 << 62)
                lib.w8a8_vnni_from(1 << 62)
                row.append(f"w8a8-rows:{_ms(w8a8):.3f}")
                lib.w8a8_amx_from(amx)
                lib.w8a8_vnni_from(vnni_from)
            row.append(f"fp32:{_ms(lambda: torch.nn.functional.linear(x, w)):.2f}")
            print(*row, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
