"""The headline table at the top of docs/benchmarks.md: one row per figure a user asks about first
(offline throughput, first tokens of chat streams, serving and one stream at user scale and on
Gemma 3, a long prompt, a quantized model, structured output, start-up, memory), each
with pagedllm's figure, the peer's, their ratio, and the run's date, commit, CPU and ISA line.

Every row is read from a committed result file (ROWS names the file and what to take from it); a
file without a run record of its own takes one from benchmarks/results/provenance.json. A run from
a tree with uncommitted changes (`+dirty`) is shown marked as not citable: the rows prefer clean
runs, and keep a dirty one only where no clean run of that figure exists on that CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pagedllm.benchmarks import report_render as rr
from pagedllm.benchmarks.report_render import GIB, citable, command, cpu, load, short_commit, table, with_record


@dataclass
class Figure:
    pagedllm: str
    peer: str
    ratio: float  # above 1: pagedllm ahead (a rate over the peer's, or the peer's time or memory over pagedllm's)
    meta: dict[str, Any]


def _throughput(dtype: str, metric: str) -> Callable[[dict[str, Any]], Figure]:
    def get(r: dict[str, Any]) -> Figure:
        rows = {x["backend"]: x for x in r["results"] if x.get("ok") and x.get("dtype") == dtype}
        ours, peer = rows["pagedllm"], rows["vllm"]
        if metric == "output":
            a, b = ours["output_tokens_per_s"], peer["output_tokens_per_s"]
            return Figure(f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b, r["meta"])
        if metric == "startup":
            a, b = ours["startup_s"], peer["startup_s"]
            return Figure(f"{a:.1f} s", f"{b:.1f} s", b / a, r["meta"])
        a, b = ours["peak_rss_bytes"] / GIB, peer["peak_rss_bytes"] / GIB
        return Figure(f"{a:.2f} GiB", f"{b:.2f} GiB", b / a, r["meta"])
    return get


def _latency(dtype: str, peer: str, phase: str) -> Callable[[dict[str, Any]], Figure]:
    def get(r: dict[str, Any]) -> Figure:
        run = next(x for x in r["runs"] if x["dtype"] == dtype)
        ours, other = run["pagedllm"], run[peer]
        if phase == "decode":
            return Figure(f"{ours['decode_tokens_per_s']:.1f} tok/s", f"{other['decode_tokens_per_s']:.1f} tok/s",
                          other["pagedllm_decode_speedup"], ours["meta"])
        return Figure(f"{ours['prefill_ms'] / 1e3:.2f} s", f"{other['prefill_ms'] / 1e3:.2f} s",
                      other["pagedllm_prefill_speedup"], ours["meta"])
    return get


def _scale_throughput(r: dict[str, Any]) -> Figure:
    t = r["throughput"]
    rows = {x["backend"]: x for x in t["results"] if x.get("ok")}
    a, b = rows["pagedllm"]["output_tokens_per_s"], rows["vllm"]["output_tokens_per_s"]
    return Figure(f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b, t["meta"])


def _scale_stream(scheme: str) -> Callable[[dict[str, Any]], Figure]:
    def get(r: dict[str, Any]) -> Figure:
        s = r["single_stream"]
        row = next(x for x in s["rows"] if x["pagedllm_scheme"] == scheme)
        a, b = row["pagedllm"]["decode_tokens_per_s"], row["llama.cpp"]["decode_tokens_per_s"]
        return Figure(f"{a:.2f} tok/s", f"{b:.2f} tok/s", a / b, s["meta"])
    return get


def _scale_serve(rate: str) -> Callable[[dict[str, Any]], Figure]:
    def get(r: dict[str, Any]) -> Figure:
        s = r["serve"]
        runs = {x["engine"]: x for x in s["runs"] if str(x["request_rate"]) == rate}
        a, b = runs["pagedllm"]["output_tokens_per_s"], runs["vllm"]["output_tokens_per_s"]
        return Figure(f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b, s["meta"])
    return get


def _chat_ttft(streams: int) -> Callable[[dict[str, Any]], Figure]:
    def get(r: dict[str, Any]) -> Figure:
        level = {e["engine"]: next(x for x in e["levels"] if x["streams"] == streams) for e in r["engines"]}
        a, b = level["pagedllm"]["ttft_mean_ms"], level["vllm"]["ttft_mean_ms"]
        return Figure(f"{a:.0f} ms", f"{b:.0f} ms", b / a, r["meta"])
    return get


def _quantized(scheme: str, peer: str) -> Callable[[dict[str, Any]], Figure]:
    def get(r: dict[str, Any]) -> Figure:
        rows = {x["scheme"]: x for x in r["rows"]}
        a, b = rows[scheme]["decode_tok_s"], rows[peer]["decode_tok_s"]
        return Figure(f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b, r["meta"])
    return get


def _structured(r: dict[str, Any]) -> Figure:
    rows = {x["backend"]: x for x in r["results"] if x.get("ok")}
    a, b = rows["pagedllm"]["constrained_tokens_per_s"], rows["vllm"]["constrained_tokens_per_s"]
    return Figure(f"{a:.1f} tok/s", f"{b:.1f} tok/s", a / b, r["meta"])


# (what, peer, result file, figure); the rows prefer each CPU's newest clean run of the figure.
ROWS: tuple[tuple[str, str, str, Callable[[dict[str, Any]], Figure]], ...] = (
    ("Offline throughput, 128 requests, bf16 (output)", "vLLM", "amx_throughput.json",
     _throughput("bfloat16", "output")),
    ("Offline throughput, 128 requests, float32 (output)", "vLLM", "zen3_throughput.json",
     _throughput("float32", "output")),
    ("Chat, 16 guidellm streams, 256-token prompts (mean time to first token)", "vLLM", "amx_ttft_serve.json",
     _chat_ttft(16)),
    ("One stream, bf16 decode (AVX2: the default)", "llama.cpp", "zen3_latency.json",
     _latency("bfloat16", "llama.cpp", "decode")),
    ("One stream, float32 decode", "llama.cpp", "zen3_latency.json", _latency("float32", "llama.cpp", "decode")),
    ("Llama-3.2-1B shape: offline throughput, 16 requests, bf16 (output)", "vLLM", "amx_scale-llama-3.2-1b.json",
     _scale_throughput),
    ("Llama-3.2-1B shape: served, 32 requests at once, bf16 (output)", "vLLM", "amx_scale-llama-3.2-1b.json",
     _scale_serve("inf")),
    ("Llama-3.2-1B shape: one stream, bf16 decode", "llama.cpp BF16", "amx_scale-llama-3.2-1b.json",
     _scale_stream("bf16")),
    ("Gemma 3 270M: offline throughput, 128 requests, bf16 (output)", "vLLM", "amx_gemma3_throughput.json",
     _throughput("bfloat16", "output")),
    ("Gemma 3 270M Q4_K_M GGUF: one stream decode", "llama.cpp (same file)", "amx_gemma3_latency_gguf.json",
     _latency("bfloat16", "llama.cpp", "decode")),
    ("Long prompt, 7,000 tokens, bf16 (time to first token)", "HF transformers", "amx_prefill.json",
     _latency("bfloat16", "hf", "prefill")),
    ("Quantized, 4-bit (int4 g32 vs Q4_0), one stream decode", "llama.cpp", "quantization_speed_final.json",
     _quantized("int4-g32", "llama.cpp q4_0")),
    ("Structured output, 64 JSON-schema requests, bf16 (output)", "vLLM", "amx_structured.json", _structured),
    ("Start-up to ready, bf16", "vLLM", "amx_throughput.json", _throughput("bfloat16", "startup")),
    ("Peak memory (RSS), 128 requests, bf16", "vLLM", "amx_throughput.json", _throughput("bfloat16", "rss")),
)


def headline_rows(results: Path) -> list[dict[str, Any]]:
    rows = []
    for what, peer, name, figure in ROWS:
        data = load(results / name)
        if data is None:
            continue
        try:
            f = figure(with_record(data, name, results))
        except (KeyError, StopIteration, TypeError, ZeroDivisionError):
            continue  # a result file of another shape under that name: no headline row from it
        name_, isa = cpu(f.meta, name)
        rows.append({"what": what, "peer": peer, "file": name, "figure": f, "cpu": name_, "isa": isa})
    return rows


def headline_section(results: Path, img: Path, draw: bool = True) -> str:
    rows = headline_rows(results)
    if not rows:
        return ""
    commands: list[str] = []
    cells = []
    for row in rows:
        f, meta = row["figure"], row["figure"].meta
        cmd = command(meta)
        if cmd not in commands:
            commands.append(cmd)
        n = commands.index(cmd) + 1
        commit = short_commit(meta.get("commit"))
        if meta.get("provenance"):
            commit += " ‡"
        elif not citable(meta.get("commit")):
            commit += " (not citable)"
        cells.append([row["what"], f.pagedllm, f"{row['peer']}: {f.peer}", f"**{f.ratio:.2f}x**",
                      str(meta.get("time", "?"))[:10], commit,
                      row["cpu"], row["isa"],
                      f"[{n}](#headline-commands) ([data](../benchmarks/results/{row['file']}))"])
    if draw:
        _plot(rows, img)
    out = ["## Headline\n\n"
           "The default model (SmolLM2-135M-Instruct) where a row names no other, 2 cores, prompts of random token ids, greedy decoding with "
           "`ignore_eos`, every engine on the same workload in its own fresh process. **x** = how many times "
           "pagedllm is ahead: its rate over the peer's, or the peer's time or memory over pagedllm's (above 1: "
           "pagedllm faster or smaller). Each row names the CPU and ISA line it ran on; figures from different "
           "CPUs are not comparable with each other.\n\n",
           table(["figure", "pagedllm", "peer", "x", "date", "commit", "CPU", "ISA", "command"], cells),
           "\n\"not citable\": the run's tree had uncommitted changes (`+dirty`); no clean run of that figure on that "
           "CPU exists yet, so it stays, marked. ‡: the run recorded no commit of its own; the commit is the one "
           "that added its results (benchmarks/results/provenance.json says where each field comes from).\n",
           "\n<a id=\"headline-commands\"></a>Commands (run from the repository root; `make peers` installs vLLM's "
           "CPU build and llama.cpp):\n\n"]
    out += [f"{i}. `{c}`\n" for i, c in enumerate(commands, 1)]
    out.append(f"\n![pagedllm against its peers: the headline rows' ratios](img/{img.name})\n")
    return "".join(out)


def _plot(rows: list[dict[str, Any]], img: Path) -> None:
    plt = rr.pyplot()
    labels = [f"{r['what']} [{r['isa']}] vs {r['peer']}" for r in rows]
    ratios = [r["figure"].ratio for r in rows]
    colors = ["C0" if citable(r["figure"].meta.get("commit")) else "C7" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.2))
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, ratios, color=colors)
    for y, v in zip(ys, ratios):
        ax.text(v, y, f" {v:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(0.5, 2 * max(ratios))
    ax.set_xlabel("pagedllm ahead by (x, log scale; grey: run not citable)")
    ax.set_title("pagedllm against its peers (headline rows)", fontsize=10)
    fig.tight_layout()
    fig.savefig(img, dpi=120)
    plt.close(fig)
