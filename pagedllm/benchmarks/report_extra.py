"""The report's sections for results that are not a plain `pagedllm bench` run: the scheduling
experiments (prefix caching, policies, preemption), later single-engine reruns, the per-step host
time before and after the persistent input batch, and the AMX host's part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import fmt, load, machine, run_block, table
from pagedllm.benchmarks.report_sections import latency_matrix_table, throughput_section


def scheduling_section(r: dict[str, Any]) -> str:
    """Prefix caching, policies under a mixed workload, and the cost of each preemption mode."""
    quick = " --quick" if r.get("quick") else ""
    env = dict(r.get("env") or {})
    env["command"] = f".venv/bin/pagedllm bench scheduling{quick} --threads {r.get('torch_threads', 1)}"
    out = ["## Scheduling: prefix caching, policies, preemption\n\n", run_block(env)]
    sp = r.get("shared_prefix")
    if sp:
        w = sp["workload"]
        out.append(f"\n### Shared prefix\n\n{w['requests']} requests behind one {w['prefix_tokens']}-token system "
                   f"prompt with short unique suffixes, {w['output_tokens']} output tokens each, greedy.\n\n")
        rows = [[name, fmt(v["elapsed_s"]), fmt(v["output_tok_per_s"]), fmt(v["total_tok_per_s"]),
                 fmt(v["ttft_mean_s"], ".2f"), fmt(v["ttft_p99_s"], ".2f"), str(v["cached_prompt_tokens"]),
                 fmt(100 * v["prefix_cache_hit_rate"])]
                for name, v in sp["runs"].items()]
        out.append(table(["prefix caching", "time s", "output tok/s", "total tok/s", "TTFT mean s", "TTFT p99 s",
                          "cached prompt tokens", "hit rate %"], rows))
        out.append(f"\nThroughput with caching on / off: **{sp['speedup']:.2f}x**.\n")
    mx = r.get("mixed")
    if mx:
        w = mx["workload"]
        out.append(f"\n### Short requests behind long prompts\n\n{w['short']} short requests queued behind "
                   f"{w['long']} prompts of {w['long_tokens']} tokens; latency from arrival to the last token.\n\n")
        rows = [[name, fmt(v["short_mean_s"], ".2f"), fmt(v["short_p99_s"], ".2f"), fmt(v["long_mean_s"], ".2f"),
                 fmt(v["elapsed_s"])] for name, v in mx["runs"].items()]
        out.append(table(["policy", "short mean s", "short p99 s", "long mean s", "total s"], rows))
    pr = r.get("preemption")
    if pr:
        rates = pr["rates"]
        out.append(f"\n### Recompute versus swap\n\nMeasured in the same run: {rates['flops_per_s'] / 1e9:.1f} "
                   f"GFLOP/s and {rates['copy_bytes_per_s'] / 1e9:.2f} GB/s of block copies. Cost of one "
                   "preemption of a request holding N tokens (recompute: its prefill again; swap: its blocks out "
                   "to the host pool and back):\n\n")
        rows = [[str(x["tokens"]), str(x["blocks"]), fmt(1e3 * x["recompute_s"]), fmt(1e3 * x["swap_s"], ".2f"),
                 fmt(1e3 * x["model_recompute_s"]), fmt(1e3 * x["model_swap_s"], ".2f")] for x in pr["per_length"]]
        out.append(table(["tokens", "blocks", "recompute ms", "swap ms", "cost model: recompute ms",
                          "cost model: swap ms"], rows))
        out.append(f"\nBreak-even: {pr['measured_break_even_tokens']} tokens measured, "
                   f"{pr['cost_model_break_even_tokens']:.0f} by the cost model (`--preemption-mode auto` swaps "
                   "whenever the host pool has room, here). A pool too small for a batch of growing requests, "
                   "end to end:\n\n")
        rows = [[mode, fmt(v["elapsed_s"]), str(v["preemptions"]), str(v["by_mode"]),
                 "yes" if v["same_tokens_as_roomy"] else "NO"] for mode, v in pr["end_to_end"].items()]
        out.append(table(["mode", "time s", "preemptions", "by mode", "same greedy tokens as without preemption"],
                         rows))
        out.append(f"\nRecompute costs {1e3 * pr['recompute_minus_swap_s_per_preemption']:.0f} ms more than swap "
                   "per preemption in that run.\n")
    return "".join(out)


def later_throughput_section(runs: list[dict[str, Any]], main: dict[str, Any] | None) -> str:
    """Single-engine reruns of the throughput workload after changes, set against the peers measured above."""
    peers = {x["backend"]: x for x in (main or {}).get("results", []) if x.get("ok") and x["backend"] != "pagedllm"}
    out = ["## Later pagedllm runs of the same workload\n\n"
           "Reruns of pagedllm alone after engine changes, compared with the peers' figures from the side-by-side "
           "run above (same workload, seed and machine).\n\n"]
    for r in runs:
        out.append(run_block(r.get("meta")))
        for x in r.get("results", []):
            if x.get("backend") != "pagedllm" or not x.get("ok"):
                continue
            ratios = ", ".join(f"{x['output_tokens_per_s'] / p['output_tokens_per_s']:.2f}x {name}"
                               for name, p in peers.items())
            out.append(f"\npagedllm: {x['output_tokens_per_s']:.1f} output tok/s, {x['total_tokens_per_s']:.1f} "
                       f"total tok/s, peak RSS {x['peak_rss_bytes'] / 2**30:.2f} GiB, MFU {100 * x['mfu']:.1f}%"
                       + (f" ({ratios} in output tok/s)" if ratios else "") + ".\n\n")
    return "".join(out)


HOST_PARTS = ("schedule", "update_states", "build_batch", "sampling_metadata", "sampler", "update_from_output",
              "process_outputs", "host", "forward")


def host_overhead_section(r: dict[str, Any]) -> str:
    """Per-step host time of decode steps before and after the persistent input batch
    (benchmarks/host_overhead.py run on both trees in one sitting), with the throughput runs."""
    before, after = r["before"]["us_per_step_median"], r["after"]["us_per_step_median"]
    rows = []
    for n in before:
        b, a = before[n], after.get(n, {})
        for part in HOST_PARTS:
            if part in b or part in a:
                ratio = f"{b[part] / a[part]:.2f}x" if part in a and part in b and a[part] > 0 else "-"
                rows.append([n, part, fmt(b.get(part), ".0f"), fmt(a.get(part), ".0f"), ratio])
    parts = [
        "## Per-step host time: the persistent input batch\n",
        "Median microseconds per decode step (all N requests decode one token), bfloat16, SmolLM2-135M; "
        "`host` is the step's wall time minus the model forward (attention included) and the LM head. "
        "Before: " + r["before"]["tree"] + "; after: " + r["after"]["tree"] + ". Same machine, one sitting "
        "(shared 2 cores, load average " + r.get("load", "?") + "), one script run per tree"
        + (f"; machine {machine(r['meta'])}, results committed in {r['meta']['commit']}" if r.get("meta") else "")
        + ":\n",
        f"```\n{r['command']}\n```\n",
        table(["N", "part", "before (µs)", "after (µs)", "before / after"], rows),
    ]
    if micro := r["after"].get("micro_us"):
        mrows = [[n, fmt(m["build_batch"], ".0f"), fmt(m.get("prepare"), ".0f"), fmt(m["from_rows"], ".0f"),
                  fmt(m.get("from_batch"), ".0f"), fmt(m.get("cached_metadata"), ".0f")] for n, m in micro.items()]
        parts += ["\nThe runner's part alone (`--micro`: best of 50 calls, µs, one decode step of N greedy "
                  "requests with 512 tokens of context each; the same code in both trees for the old way):\n",
                  table(["N", "build_batch (RequestState)", "InputBatch.prepare", "SamplingMetadata.from_rows",
                         "from_batch", "cached + with_token_state"], mrows)]
    if tp := r.get("throughput"):
        trows = [[k, fmt(v["output_tokens_per_s"]), fmt(v["elapsed_s"])] for k, v in tp["runs"].items()]
        parts += ["\nThroughput on the 128-request workload, before and after, in the same sitting:\n",
                  f"```\n{tp['command']}\n```\n", table(["run", "output tok/s", "elapsed (s)"], trows)]
    if note := r.get("note"):
        parts.append("\n" + note + "\n")
    return "\n".join(parts)


def amx_section(res: Path, img_dir: Path, draw: bool = True) -> str:
    """The AMX host's part: its notes (amx.md), then the side-by-side runs measured there, each with the
    command and machine it ran on."""
    parts = [(res / "amx.md").read_text()] if (res / "amx.md").exists() else []
    if (t := load(res / "amx_throughput.json")) is not None:
        parts.append(throughput_section(t, img_dir / "bench-throughput-amx.png", draw).replace(
            "## Offline throughput", "### Offline throughput on the AMX host", 1))
    for name, title in (("amx_latency.json", "Single-request latency on the AMX host"),
                        ("amx_float16_latency.json", "float16 against bfloat16, one request, on the AMX host"),
                        ("amx_prefill.json", "Long-context prefill on the AMX host")):
        if (m := load(res / name)) is not None:
            parts.append(f"### {title}\n\n" + latency_matrix_table(m))
    if (ps := prompt_step_section(res)) is not None:
        parts.append(ps)
    return "\n".join(parts)


def prompt_step_section(res: Path) -> str | None:
    """One 256-token prompt step before and after its elementwise kernels split their rows over the
    team (amx_prompt256_{before,after}_t{2,1}.json: `bench latency` at OMP_NUM_THREADS 2 and 1)."""
    runs = {(tag, t): m for tag in ("before", "after") for t in (2, 1)
            if (m := load(res / f"amx_prompt256_{tag}_t{t}.json")) is not None}
    if not runs:
        return None
    rows = []
    for t in (2, 1):
        b, a = runs.get(("before", t)), runs.get(("after", t))
        ms = [r["prefill_ms"] if r else None for r in (b, a)]
        rows.append([str(t), fmt(ms[0]), fmt(ms[1]),
                     f"{ms[0] / ms[1]:.2f}x" if ms[0] and ms[1] else "-"])
    out = ["### Prompt steps of 256 tokens on the AMX host\n\n"
           "The prefill time of one 256-token prompt (the default model, bf16, median of 30 requests), "
           "before and after the residual add + RMSNorm and RoPE kernels split their rows over the team "
           "from 2^14 elements (they kept 256 x 576 on one thread before) and the flash kernel writes a chunk's "
           "attention into the step's output instead of a tensor copied there afterwards. One thread "
           "runs the same code either way. The two-thread pair was rerun back to back (before, then after): 90.7 "
           "against 81.5 ms. Served, no change: the two 16-stream guidellm runs of the same hour (amx_ttft_prompt_*.json, "
           "under the time-to-first-token section) gave 828 ms mean time to first token before and 842 after, "
           "204.8 output tok/s both; their steps carry up to 1,024 prompt tokens beside the decodes, rows the "
           "kernels split before too.\n\n",
           table(["threads", "before ms", "after ms", "speed-up"], rows), "\n"]
    for (tag, t), m in runs.items():
        out.append(f"\n{tag}, {t} thread{'s' if t > 1 else ''}:\n\n" + run_block(m.get("meta")))
    return "".join(out)




def _metas(node: Any) -> list[dict[str, Any]]:
    """Every run record (`meta` / `env` with a commit) inside a result file, in file order."""
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("meta", "env") and isinstance(value, dict) and value.get("commit"):
                out.append(value)
            else:
                out += _metas(value)
    elif isinstance(node, list):
        for value in node:
            out += _metas(value)
    return out


def runs_appendix(res: Path) -> str:
    """One row per result file and run record: the commit, time and CPU each figure on this page
    comes from, and whether it is citable (a clean tree)."""
    from pagedllm.benchmarks.report_render import citable, cpu, provenance, short_commit

    records = provenance(res)
    rows, unrecorded = [], []
    for path in sorted(res.glob("*.json")):
        if path.name in ("hosts.json", "provenance.json") or (data := load(path)) is None:
            continue
        metas = _metas(data) or ([dict(records[path.name], _source=path.name)] if path.name in records else [])
        if not metas:
            unrecorded.append(path.name)
            continue
        seen = []
        for m in metas:
            key = (m.get("commit"), m.get("cpu_model"))
            if key in seen:
                continue
            seen.append(key)
            name, isa = cpu(m, path.name)
            times = sorted(str(x.get("time", "?")) for x in metas if (x.get("commit"), x.get("cpu_model")) == key)
            when = times[0] if times[0] == times[-1] else f"{times[0]} to {times[-1][11:]}"
            rows.append([f"`{path.name}`", short_commit(m.get("commit")), when, name, isa,
                         "yes" if citable(m.get("commit")) else "no (+dirty)"])
    out = ["## The runs behind this page\n\n"
           "Every result file in benchmarks/results with a run record: the commit it ran at, when, on which CPU "
           "(hosts.json), and whether its figures are citable (a run from a tree with uncommitted changes is "
           "not). A figure quoted in a hand-written section comes from the file that section names.\n\n",
           table(["file", "commit", "run (UTC)", "CPU", "ISA", "citable"], rows)]
    if unrecorded:
        out.append("\nWithout a run record of their own (written before the scripts recorded one; the sections that "
                   "quote them name the host and the commit that added them): "
                   + ", ".join(f"`{n}`" for n in unrecorded) + ".\n")
    return "".join(out)


def structured_section(r: dict[str, Any]) -> str:
    """`pagedllm bench structured`: constrained decoding against the same workload unconstrained and
    against vLLM's CPU build, with the grammar compile times."""
    wl = r["workload"]
    rows = []
    for x in r["results"]:
        if not x.get("ok"):
            rows.append([x["backend"], "skipped: " + x.get("reason", ""), "", "", "", ""])
            continue
        rows.append([x["backend"], str(x.get("dtype")), f"{x['constrained_tokens_per_s']:.1f}",
                     f"{x['unconstrained_tokens_per_s']:.1f}", f"{x['constrained_vs_unconstrained']:.3f}",
                     f"{x['stopped'] - x['invalid']} / {x['stopped']}"])
    out = [
        "## Structured output\n",
        f"{wl['num_requests']} {wl['kind']} requests at once (the bundled schemas of "
        "pagedllm/benchmarks/schemas.py: nested objects, arrays with bounds, enums, anyOf, patterns, numeric "
        f"bounds, $ref), greedy, up to {wl['max_tokens']} tokens each. Each engine runs the constrained requests "
        "(after one warm-up pass), then the same prompts unconstrained with each reply's token count and "
        "ignore_eos: the same tokens from the same prompts in the same batch. Valid: replies that ended with "
        "\"stop\" and validate with `jsonschema`.\n",
        table(["engine", "dtype", "constrained tok/s", "unconstrained tok/s", "constrained / unconstrained",
               "valid / stopped"], rows),
    ]
    c = r.get("compile")
    if c:
        out.append(f"\nGrammar compilation per schema (xgrammar, {c['schemas']} schemas): cold p50 "
                   f"{c['cold_p50_ms']:.2f} ms, p99 {c['cold_p99_ms']:.2f} ms; from the cache p50 "
                   f"{c['cached_p50_ms']:.3f} ms, p99 {c['cached_p99_ms']:.3f} ms.")
    out.append("\n" + run_block(r["meta"]))
    return "\n".join(out) + "\n"


def embed_section(runs: list[dict[str, Any]]) -> str:
    """`pagedllm bench embed`: all-MiniLM-L6-v2 embeddings against sentence-transformers' encode and,
    where the run has it, vLLM's CPU build."""
    def vllm_cells(r: dict[str, Any]) -> list[str]:
        v = r.get("vllm")
        if not v:
            return ["not run", "", ""]
        if not v["ok"]:
            return ["skipped", "", ""]
        return [f"{v['texts_per_s']:.1f}", f"{v['ratio']:.2f}x", f"{v['min_cosine']:.6f}"]

    rows = [[r["config"]["dtype"], str(r["config"]["num_texts"]), str(r["prompt_tokens"]),
             f"{r['pagedllm_texts_per_s']:.1f}", f"{r['sentence_transformers_texts_per_s']:.1f}",
             f"{r['ratio']:.2f}x", f"{r['min_cosine']:.6f}", *vllm_cells(r)] for r in runs]
    out = [
        "## Embeddings\n",
        "`pagedllm bench embed`: all-MiniLM-L6-v2 (the packaged sentence-transformers model) embedding the same "
        "texts with `LLM.embed` (every text at once, batched by the step budget), with sentence-transformers' "
        f"`encode` (float32, batch size {runs[0]['config']['batch_size']}) and with vLLM's CPU build (`LLM.embed`, "
        "runner \"pooling\", pagedllm's dtype and step budget, in its own process), one after the other in the "
        "same run, each after a warm-up pass. Ratios are pagedllm's rate over the other's; the cosines are of "
        "each text's embedding against pagedllm's. The host was shared with other jobs: the absolute rates move "
        "between runs; the ratios are of the same run.\n",
        table(["pagedllm dtype", "texts", "tokens", "pagedllm texts/s", "sentence-transformers texts/s", "ratio",
               "smallest cosine", "vLLM texts/s", "vs vLLM", "smallest cosine (vLLM)"], rows),
    ]
    out += ["\n" + run_block(r["meta"]) for r in runs]
    return "\n".join(out) + "\n"


def embed_mixed_section(r: dict[str, Any]) -> str:
    """`pagedllm bench embed-mixed`: a generation load's mean TPOT, alone and with embeddings mixed in."""
    c = r["config"]
    rows = [[str(i), f"{x['alone']['mean_tpot_ms']:.2f}", f"{x['mixed']['mean_tpot_ms']:.2f}", f"{x['ratio']:.3f}x",
             f"{x['mixed']['mean_embedding_latency_ms']:.1f}"] for i, x in enumerate(r["rounds"])]
    rows.append(["mean", f"{r['mean_tpot_alone_ms']:.2f}", f"{r['mean_tpot_mixed_ms']:.2f}", f"{r['ratio']:.3f}x", ""])
    out = [
        "## Embeddings mixed into generation\n",
        f"`pagedllm bench embed-mixed`: {c['model']} ({c['dtype']}) serving {c['num_requests']} generation requests "
        f"at {c['request_rate']} requests/s (Poisson, {c['prompt_words']}-word prompts, {c['output_len']} tokens "
        f"each), alone and with {r['embedding_requests_per_phase']} embedding requests at {c['embed_rate']}/s "
        f"({r['embedding_prompt_tokens_mean']:.0f} tokens on average) on the same engine (the decoder's LAST "
        "pooling), phases alternated. The target: the mixed-in embeddings raise the generation's mean TPOT by at "
        "most 10%. The host was shared with other jobs.\n",
        table(["round", "TPOT alone (ms)", "TPOT with embeddings (ms)", "ratio", "embedding latency (ms)"], rows),
        "\n" + run_block(r["meta"]),
    ]
    return "\n".join(out) + "\n"
