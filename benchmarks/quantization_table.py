"""Markdown table of docs/quantization.md from benchmarks/results/quantization.json."""

from __future__ import annotations

import json
import sys

ORDER = ["fp32", "bf16", "int8", "w8a8", "int4-g32", "int4-g128", "fp8", "gguf-q4_1", "ffn-int8", "ffn-int4",
         "llama.cpp q4_1"]


def fmt(v, spec: str) -> str:
    return "not measured" if v is None else format(v, spec)


def main(*paths: str) -> None:
    rows = {r["scheme"]: r for p in paths or ("benchmarks/results/quantization.json",)
            for r in json.load(open(p))["rows"]}
    base = rows.get("bf16") or {}
    fp32 = rows["fp32"]["weight_mib"]
    print("| scheme | weight MiB (× fp32) | PPL ctx 512 | Δ vs bf16 | PPL ctx 4096 | Δ vs bf16 "
          "| decode tok/s | throughput tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ORDER:
        r = rows.get(name)
        if r is None:
            continue
        mem = r.get("weight_mib")
        mem_s = f"{mem:.0f} ({mem / fp32:.2f}×)" if mem else "—"
        d512 = r["ppl512"] - base["ppl512"] if base else None
        d4k = r["ppl4096"] - base["ppl4096"] if base and "ppl4096" in r else None
        print(f"| {name} | {mem_s} | {r['ppl512']:.3f} ± {r['ppl512_err']:.3f} | {fmt(d512, '+.3f')} "
              f"| {fmt(r.get('ppl4096'), '.3f')} | {fmt(d4k, '+.3f')} | {fmt(r.get('decode_tok_s'), '.2f')} "
              f"| {fmt(r.get('throughput_tok_s'), '.1f')} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
