"""docs/benchmarks.md's sections on the model families beyond the default model: mixture-of-experts
decode from the result files of `pagedllm bench moe` (MOE_FILES: benchmarks/results/moe*.json and
the AMX host's amx_moe*.json, one run each, in name order), throughput and one stream of another model from `pagedllm bench throughput --model M
--compare ...` (THROUGHPUT_FILES: benchmarks/results/family-throughput-*.json, and Gemma 3's runs,
HOST_gemma3_throughput*.json) and `pagedllm bench latency --model M --compare ...` (LATENCY_FILES:
family-latency-*.json, HOST_gemma3_latency*.json; one section per model, a table per file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import load, run_block
from pagedllm.benchmarks.report_sections import latency_matrix_table
from pagedllm.benchmarks.throughput import format_table

MOE_FILES = ("amx_moe*.json", "moe*.json")
THROUGHPUT_FILES = ("family-throughput-*.json", "*_gemma3_throughput*.json")
LATENCY_FILES = ("family-latency-*.json", "*_gemma3_latency*.json")

INTRO = """## Mixture-of-experts decode (Qwen3-MoE shape)

`pagedllm bench moe` builds a Qwen3-MoE-shaped model with random weights (8 experts, top-2
renormalised, hidden 1024; transformers writes its config and bf16 safetensors, with the default
model's tokenizer) and the same weights as a BF16 GGUF under llama.cpp's `qwen3moe` names (written
with gguf-py's `GGUFWriter`: llama-cpp-python ships no `convert_hf_to_gguf`;
tests/integration/test_bench_moe_gguf.py checks that llama.cpp scores token windows on such a GGUF
as pagedllm does on the folder). Throughput: pagedllm against HF transformers (its best static
batch) on random requests; one stream: a 128-token prompt and 64 greedy tokens, pagedllm against
llama.cpp on the GGUF with the same threads. pagedllm runs the experts as one GEMM per active
expert on its tokens' rows (`layers/moe.py`); since a314b85 decode steps of up to 256 rows run the
MoE layers in the fused native decode step (`worker/native_moe.py`), before it as torch ops.
"""


def _single_stream(row: dict[str, Any]) -> str:
    ours, peer = row["pagedllm"], row["llama.cpp"]
    line = (f"One stream ({row['dtype']}): pagedllm prefill {ours['prefill_ms']:.1f} ms, decode "
            f"{ours['decode_ms_per_token']:.2f} ms/token")
    if not peer.get("ok"):
        return line + f"; llama.cpp skipped: {peer['reason']}.\n"
    return (line + f"; llama.cpp {peer['prefill_ms']:.1f} ms, {peer['decode_ms_per_token']:.2f} ms/token: pagedllm "
            f"decodes at {row['decode_speedup_vs_llamacpp']:.2f}x llama.cpp's speed and prefills at "
            f"{row['prefill_speedup_vs_llamacpp']:.2f}x.\n")


def moe_section(results: Path) -> str | None:
    runs = [r for p in _files(results, MOE_FILES) if (r := load(p)) is not None]
    if not runs:
        return None
    out = [INTRO]
    for r in runs:
        c = r["model"]["config"]
        out.append(f"Model: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_experts']} experts of "
                   f"width {c['moe_intermediate_size']}, top-{c['num_experts_per_tok']}, vocabulary {c['vocab_size']}.\n")
        if "throughput" in r:
            out.append("```\n" + format_table(r["throughput"]) + "\n```\n")
        if "single_stream" in r:
            out.append(_single_stream(r["single_stream"]))
        if r.get("note"):
            out.append(r["note"] + "\n")
        out.append(run_block(r.get("meta")))
    return "\n".join(out)


def _files(results: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The result files matching any of the patterns, in name order."""
    return sorted({p for pattern in patterns for p in results.glob(pattern)})


def model_throughput_sections(results: Path) -> list[str]:
    """One section per result file of THROUGHPUT_FILES (`pagedllm bench throughput --model M
    --compare ...`: each engine's row and its ratio to pagedllm)."""
    out = []
    for p in _files(results, THROUGHPUT_FILES):
        if (r := load(p)) is None:
            continue
        out.append(f"## Throughput: {r['model']['name']}\n\n```\n{format_table(r)}\n```\n"
                   + (f"\n{r['note']}\n" if r.get("note") else "") + "\n" + run_block(r.get("meta")))
    return out


def model_latency_sections(results: Path) -> list[str]:
    """One section per model of the LATENCY_FILES (latency matrices with their peers): each file's
    table, run record and note, in name order."""
    tables: dict[str, list[str]] = {}
    for p in _files(results, LATENCY_FILES):
        if (m := load(p)) is None:
            continue
        tables.setdefault(m["runs"][0]["pagedllm"]["model"]["name"], []).append(latency_matrix_table(m))
    return [f"## One stream: {name}\n\n" + "\n".join(parts) for name, parts in tables.items()]
