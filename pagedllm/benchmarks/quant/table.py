"""Markdown table of docs/quantization.md from the JSON files of pagedllm bench quant schemes.

Rows of the same scheme in several files are merged, later files winning; decode and throughput
figures come only from speed files (``bench_quantization.py --speed``), quality from the others. With --write FILE the table replaces the text between the
``<!-- quantization-table -->`` and ``<!-- /quantization-table -->`` markers of FILE.

Run: pagedllm bench quant table [--write docs/quantization.md] \\
     benchmarks/results/quantization_ppl.json benchmarks/results/quantization_ppl_llamacpp_files.json \\
     benchmarks/results/quantization_speed.json
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from pagedllm.benchmarks.script import parser

ORDER = ["fp32", "bf16", "int8", "int8-unfused", "w8a8", "int4-g32", "int4-g128", "fp8", "gguf-q4_1", "gguf-q8_0",
         "gguf-q4_0", "ffn-int8", "ffn-int4", "int8-emb", "int4-g32-emb", "int4-g128-emb", "gguf-q4_1-emb",
         "llama.cpp q4_1", "llama.cpp q8_0", "llama.cpp q4_0"]
SPEED_KEYS = {"decode_tok_s", "decode_ms_per_token", "prefill_ms", "throughput_tok_s", "throughput_total_tok_s",
              "throughput_s", "speed_dtype", "llama_cpp_version"}
BEGIN, END = "<!-- quantization-table -->", "<!-- /quantization-table -->"


def fmt(v, spec: str) -> str:
    return "not measured" if v is None else format(v, spec)


def _speed(r: dict, key: str, base: dict, spec: str) -> str:
    v = r.get(key)
    if v is None:
        return "—" if r["scheme"].startswith("llama.cpp") and key == "throughput_tok_s" else "not measured"
    ratio = f" ({v / base[key]:.2f}×)" if base.get(key) else ""
    return format(v, spec) + ratio


def table(paths: list[str]) -> str:
    rows: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        is_speed = bool(data.get("args", {}).get("speed"))
        for r in data["rows"]:
            keep = {k: v for k, v in r.items() if is_speed == (k in SPEED_KEYS) or k == "scheme"}
            rows.setdefault(r["scheme"], {}).update(keep)
        ratios.update(data.get("ratios", {}))
    base = rows.get("bf16") or {}
    fp32 = rows.get("fp32", {}).get("weight_mib")
    out = ["| scheme | weight MiB (× fp32) | PPL ctx 512 | Δ vs bf16 | PPL ctx 4096 | Δ vs bf16 "
           "| decode tok/s (× bf16) | throughput tok/s (× bf16) |",
           "|---|---|---|---|---|---|---|---|"]
    for name in ORDER:
        r = rows.get(name)
        if r is None:
            continue
        mem = r.get("weight_mib")
        mem_s = f"{mem:.0f} ({mem / fp32:.2f}×)" if mem and fp32 else "—"
        ppl = r.get("ppl512")
        d512 = ppl - base["ppl512"] if ppl is not None and "ppl512" in base else None
        d4k = r["ppl4096"] - base["ppl4096"] if "ppl4096" in r and "ppl4096" in base else None
        ppl_s = f"{ppl:.3f} ± {r['ppl512_err']:.3f}" if ppl is not None else ("—" if name == "int8-unfused"
                                                                              else "not measured")
        # int8-unfused computes with the int8 row's weights: its perplexity is that row's.
        p4k, d4k_s = ("—", "—") if name == "int8-unfused" else (fmt(r.get("ppl4096"), ".3f"), fmt(d4k, "+.3f"))
        out.append(f"| {name} | {mem_s} | {ppl_s} | {fmt(d512, '+.3f') if ppl is not None else '—'} "
                   f"| {p4k} | {d4k_s} "
                   f"| {_speed(r, 'decode_tok_s', base, '.1f')} | {_speed(r, 'throughput_tok_s', base, '.1f')} |")
    if ratios:
        out.append("")
        out.extend(f"* {k}: **{v:.2f}×**" for k, v in ratios.items())
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    results = Path("benchmarks/results")
    default = [results / "quantization_run1.json", results / "quantization_run2.json",
               *sorted(results.glob("quantization_ppl*.json")), results / "quantization_speed_decode.json",
               results / "quantization_speed_int4.json", *sorted(results.glob("quantization_speed_w8a8*.json")),
               results / "quantization_speed_final.json", results / "quantization_quality_final.json"]
    ap.add_argument("paths", nargs="*", default=[str(p) for p in default])
    ap.add_argument("--write", default=None, help="markdown file whose marked table is replaced")
    args = ap.parse_args(argv)
    text = table([p for p in args.paths if Path(p).exists()])
    if not args.write:
        print(text)
        return
    doc = Path(args.write).read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{args.write}: no {BEGIN} ... {END} markers")
    Path(args.write).write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc))


if __name__ == "__main__":
    raise SystemExit(main())
