"""docs/benchmarks.md's section on user-scale models: the result files of `pagedllm bench scale`
(benchmarks/results/*scale-<shape>.json, in name order), one subsection per file: greedy agreement
with llama.cpp, offline throughput against vLLM, one stream against llama.cpp per dtype with the
weight-read roofline, a long prompt's time to first token, served throughput and latency against
vLLM's server, each engine's peak RSS and start-up."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import GIB, load, run_block, table

INTRO = """## User-scale models (Llama-3.2-1B and Qwen3-0.6B shapes, random weights)

`pagedllm bench scale --shape llama-3.2-1b|qwen3-0.6b` builds a model with the real model's shape
(layers, widths, heads, head width, MLP width, vocabulary, tied embeddings, RoPE; Llama's llama3
frequency scaling, Qwen3's QK-norm) and random weights (transformers' own initialisation, seeded),
saved as bf16 safetensors with the default model's tokenizer (49,152 tokens; the embedding and the
LM head keep the real vocabulary, so their cost is real; prompts are random ids below 49,152).
llama.cpp runs the same weights from a BF16 GGUF written under its `llama` / `qwen3` names, and
from Q8_0 / Q4_0 files made by its own quantizer with its default choices. Each engine runs in a
fresh process; peak RSS and start-up (spawn to model ready) are that process's. pagedllm's int8 and
int4 (group 32) quantize the linear layers at load and keep the embedding / LM head in bf16;
llama.cpp's quantizer stores its tied embedding in Q8_0 (Q8_0 file) or Q6_K (Q4_0 file). llama.cpp
runs with its extra buffer types off (the weights in the file's layout, no AMX / AVX-512 repacking)
unless the run says `--llamacpp-extra-bufts`: its AMX buffer type stops the process on the
quantized files on the AMX host (a segmentation fault at the first evaluation).
The served part launches `pagedllm serve` and vLLM's server (bf16) in turn on the same folder and
sends both the same streamed, greedy requests with `pagedllm bench serve`'s client.
Targets: offline and served >= 1.5x vLLM; one stream >= 1.0x llama.cpp in every pair and >= 85 % of the
weight-read roofline (bytes of weights one decode step reads / the host's read rate: the median pass
of a read-only sum over 256 MiB, measured in the same process just before and just after the runs,
averaged; results from before that measured a 256 MiB copy once, before the runs, and counted the
bytes read and written); a 4,000-token prompt >= 1.2x llama.cpp's prompt processing.
"""


def _gib(x: dict[str, Any]) -> str:
    return f"{x['peak_rss_bytes'] / GIB:.2f}" if x.get("peak_rss_bytes") else "-"


def _agreement(a: dict[str, Any]) -> str:
    peer = a.get("llama.cpp", {})
    if not peer.get("ok"):
        return f"Greedy agreement with llama.cpp: not measured ({peer.get('reason', '?')}).\n"
    return (f"Greedy agreement, pagedllm bf16 against llama.cpp BF16 after a {a['prompt_len']}-token prompt: the "
            f"first {a['agreeing_prefix']} of {a['compared']} tokens agree ({a['agreeing_positions']} positions in "
            f"all; pagedllm {a['pagedllm_tokens']}, llama.cpp {peer['tokens']}).\n")


def _throughput(t: dict[str, Any]) -> str:
    rows = []
    for r in t["results"]:
        if not r.get("ok"):
            rows.append([r["backend"], r["dtype"], "skipped: " + r["reason"][:200], "", "", ""])
            continue
        rows.append([r["backend"], r["dtype"], f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}",
                     _gib(r), f"{r['startup_s']:.1f}"])
    w = t["workload"]
    out = (f"Offline throughput, {w.get('num_requests', '?')} requests (prompts {w['input_len_range'][0]}:"
           f"{w['input_len_range'][1]}, outputs {w['output_len_range'][0]}:{w['output_len_range'][1]} tokens):\n\n"
           + table(["engine", "dtype", "output tok/s", "total tok/s", "peak RSS GiB", "start-up s"], rows))
    if "output_speedup_vs_vllm" in t:
        out += f"\npagedllm / vLLM output tokens/s: **{t['output_speedup_vs_vllm']:.2f}x** (target 1.5x).\n"
    return out + "\n" + run_block(t.get("meta"))


def roofline_fraction(row: dict[str, Any]) -> float:
    """pagedllm's fraction of the weight-read roofline in a one-stream row: over rounds, the median
    of the rounds' fractions (each round's of the read rate measured around that round, as the
    speed-up is the median of the rounds' ratios), computed from the rounds stored in the row, so
    results written when the row held the median round's own fraction give it too; else the
    row's."""
    rounds = row.get("rounds") or []
    if rounds and all("pagedllm_fraction_of_weight_roofline" in x for x in rounds):
        return statistics.median(x["pagedllm_fraction_of_weight_roofline"] for x in rounds)
    return row["pagedllm_fraction_of_weight_roofline"]


def _roofline(row: dict[str, Any]) -> str:
    """The weight-read roofline cell: the row's fraction (scale.weight_roofline_fraction: of the read
    rate measured around the runs where the run has it, else, in results from before it, of the copy
    peak), with the copy figure beside a read one. Over rounds the fraction is the median of the
    rounds' fractions (roofline_fraction), and the rates beside it are the median round's, with that
    round's own fractions."""
    ours, frac = row["pagedllm"], 100 * roofline_fraction(row)
    weights = f"({ours['model']['decode_weight_bytes'] / 1e9:.2f} GB)"
    copy = f"{ours['peak_copy_bytes_per_s'] / 1e9:.1f} GB/s copy"
    if ours.get("peak_read_bytes_per_s") is None:
        return f"{frac:.0f} % of {copy} {weights}"
    read = f"{ours['peak_read_bytes_per_s'] / 1e9:.1f} GB/s read"
    copy_frac = f"{100 * ours['decode_weight_fraction_of_peak_bw']:.0f} % of {copy}"
    if row.get("rounds"):
        return (f"{frac:.0f} %, median of the rounds' fractions {weights}; the median round "
                f"{100 * ours['decode_weight_fraction_of_read_bw']:.0f} % of {read}, {copy_frac}")
    return f"{frac:.0f} % of {read} {weights}; {copy_frac}"


def _single_stream(s: dict[str, Any]) -> str:
    rows = []
    for row in s["rows"]:
        ours, peer = row["pagedllm"], row["llama.cpp"]
        if ours.get("ok"):
            rows.append([f"pagedllm {row['pagedllm_scheme']}", f"{ours['decode_tokens_per_s']:.2f}",
                         f"{ours['prefill_ms']:.0f}",
                         _roofline(row),
                         _gib(ours), f"{ours['startup_s']:.1f}", ""])
        else:
            rows.append([f"pagedllm {row['pagedllm_scheme']}", "skipped: " + ours["reason"][:200], "", "", "", "", ""])
        if peer.get("ok"):
            speed = row.get("decode_speedup_vs_llamacpp")
            rows.append([f"llama.cpp {row['llamacpp_type']}", f"{peer['decode_tokens_per_s']:.2f}",
                         f"{peer['prefill_ms']:.0f}", "", _gib(peer), f"{peer['startup_s']:.1f}",
                         f"**{speed:.2f}x**" if speed else ""])
        else:
            rows.append([f"llama.cpp {row['llamacpp_type']}", "skipped: " + peer["reason"][:200], "", "", "", "", ""])
    rounds = s.get("rounds", 1)
    head = (f"One stream ({s['input_len']}-token prompt, {s['output_len']} greedy tokens, median of {s['num_iters']}"
            + (f"; {rounds} rounds alternating which engine runs first: each engine's median round, the "
               "median of the rounds' speed-ups, and pagedllm's weight-read roofline as the median of the rounds' "
               "fractions, each round's of the read rate measured around it" if rounds > 1 else "") + "):\n\n")
    per_round = "".join(
        f"- {row['pagedllm_scheme']} against {row['llamacpp_type']}, round by round: "
        + ", ".join(f"{x['pagedllm_decode_tokens_per_s']:.2f} / {x['llamacpp_decode_tokens_per_s']:.2f} tok/s "
                    f"({x['decode_speedup_vs_llamacpp']:.2f}x, {x['first']} first)" for x in row["rounds"]) + "\n"
        for row in s["rows"] if row.get("rounds"))
    return (head + table(["engine", "decode tok/s", "prefill ms", "weight-read roofline", "peak RSS GiB", "start-up s",
                          "pagedllm decode x"], rows)
            + ("\n" + per_round if per_round else "") + "\n" + run_block(s.get("meta")))


def _prefill(p: dict[str, Any]) -> str:
    rows = []
    for name in ("pagedllm", "hf", "llama.cpp"):
        x = p[name]
        if not x.get("ok"):
            rows.append([name, "skipped: " + x["reason"][:200], "", "", ""])
            continue
        ratio = p.get(f"ttft_speedup_vs_{name}")
        rows.append([name, f"{x['prefill_ms'] / 1e3:.2f}", _gib(x), f"{x['startup_s']:.1f}",
                     f"**{ratio:.2f}x**" if ratio else ""])
    return (f"Time to first token of one {p['prompt_len']}-token prompt (bf16; median of {p['num_iters']} after "
            f"{p['num_warmup']} warm-up):\n\n"
            + table(["engine", "seconds", "peak RSS GiB", "start-up s", "pagedllm ahead"], rows)
            + "\n" + run_block(p.get("meta")))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"**{x:.2f}x**"


def _rate(r: float | str) -> str:
    return r if isinstance(r, str) else f"{r:g}"


def _serve(s: dict[str, Any]) -> str:
    w = s["workload"]
    servers = {x["engine"]: x for x in s["servers"]}
    rows = []
    for e, x in servers.items():
        if not x["ok"]:
            rows.append([e, "-", "not launched: " + x["reason"][:200], "", "", "", "", "", ""])
    for r in s["runs"]:
        x = servers[r["engine"]]
        rows.append([r["engine"], _rate(r["request_rate"]),
                     f"{r['completed']}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
                     f"{r['output_tokens_per_s']:.1f}", _ms(r["ttft_mean_ms"]), _ms(r["ttft_p95_ms"]),
                     _ms(r["tpot_mean_ms"]), _ms(r["tpot_p95_ms"]),
                     f"{x['peak_rss_bytes'] / GIB:.2f} / {x['startup_s']:.1f}"])
    out = (f"Served: {w['num_requests']} streamed requests per rate (prompts {w['input_len_range'][0]}:"
           f"{w['input_len_range'][1]}, outputs {w['output_len_range'][0]}:{w['output_len_range'][1]} tokens, "
           f"greedy, ignore_eos), each rate on the same request set (rate inf: all at once; a finite rate: Poisson "
           f"arrivals); server flags `{s['server_args']}`, vLLM's KV cache {s['vllm_kv_cache_space_gib']} GiB:\n\n"
           + table(["server", "rate/s", "requests", "output tok/s", "TTFT mean ms", "TTFT p95 ms", "TPOT mean ms",
                    "TPOT p95 ms", "peak RSS GiB / start-up s"], rows))
    if s["ratios"]:
        out += ("\npagedllm over vLLM (output tok/s ours / theirs; latencies theirs / ours; above 1 is pagedllm "
                "ahead; target 1.5x output tok/s):\n\n"
                + table(["rate/s", "output tok/s", "TTFT mean", "TTFT p95", "TPOT mean", "TPOT p95"],
                        [[_rate(r["request_rate"]), _x(r["output_speedup_vs_vllm"]), _x(r["ttft_mean_speedup_vs_vllm"]),
                          _x(r["ttft_p95_speedup_vs_vllm"]), _x(r["tpot_mean_speedup_vs_vllm"]),
                          _x(r["tpot_p95_speedup_vs_vllm"])] for r in s["ratios"]]))
    return out + "\n" + run_block(s.get("meta"))


def scale_section(results: Path) -> str | None:
    runs = [r for p in sorted(results.glob("*scale-*.json")) if (r := load(p)) is not None]
    if not runs:
        return None
    out = [INTRO]
    for r in runs:
        c = r["model"]["config"]
        out.append(f"### {r['shape']}-shaped: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                   f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} KV) of width {c['head_dim']}, "
                   f"MLP {c['intermediate_size']}, vocabulary {c['vocab_size']}\n")
        if "agreement" in r:
            out.append(_agreement(r["agreement"]))
        if "throughput" in r:
            out.append(_throughput(r["throughput"]))
        if "single_stream" in r:
            out.append(_single_stream(r["single_stream"]))
        if "prefill" in r:
            out.append(_prefill(r["prefill"]))
        if "serve" in r:
            out.append(_serve(r["serve"]))
        if r.get("note"):
            out.append(r["note"] + "\n")
    return "\n".join(out)
