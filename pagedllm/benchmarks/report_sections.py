"""The report's sections for `pagedllm bench` result files: offline throughput, serving (single runs,
repeated rounds, the offline baseline), latency and prefill against peers, the fused decode step,
the scheduler's overhead, KV cache memory and the KV cache dtype's correctness cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.benchmarks.report_render import GIB, checkout_relative, fmt, machine, pyplot, run_block, table


def throughput_section(r: dict[str, Any], img: Path, draw: bool = True) -> str:
    wl = r["workload"]
    rows, names, outs, totals = [], [], [], []
    for x in r["results"]:
        if not x["ok"]:
            rows.append([x["backend"], "skipped: " + x["reason"].replace("|", "/"), "", "", "", "", "", "", ""])
            continue
        v = x.get("vs_pagedllm", {})

        def ratio(key: str) -> str:
            return f" ({v[key]:.2f}x)" if key in v else ""

        label = (x["backend"] + (f" {x['dtype']}" if "dtype" in x else "")
                 + (" (default)" if x.get("dtype_requested") == "auto" else "")
                 + (f" (batch {x['best_batch_size']})" if "best_batch_size" in x else ""))
        rows.append([
            label, f"{x['requests_per_s']:.3f}{ratio('requests_per_s')}",
            f"{x['output_tokens_per_s']:.1f}{ratio('output_tokens_per_s')}",
            f"{x['total_tokens_per_s']:.1f}{ratio('total_tokens_per_s')}",
            f"{x['peak_rss_bytes'] / GIB:.2f}{ratio('peak_rss_bytes')}",
            f"{x['startup_s']:.1f}{ratio('startup_s')}", f"{x['elapsed_s']:.0f}",
            f"{100 * x['mfu']:.1f}%" if "mfu" in x else "-",
            x.get("warning", ""),
        ])
        names.append(label)
        outs.append(x["output_tokens_per_s"])
        totals.append(x["total_tokens_per_s"])
    if names and draw:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], outs, 0.4, label="output tokens/s")
        ax.bar([i + 0.2 for i in xs], totals, 0.4, label="total (prompt + output) tokens/s")
        for i, (o, t) in enumerate(zip(outs, totals)):
            ax.text(i - 0.2, o, f"{o:.0f}", ha="center", va="bottom", fontsize=8)
            ax.text(i + 0.2, t, f"{t:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"Offline throughput, {wl['num_requests']} requests ({wl['kind']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img, dpi=120)
        plt.close(fig)
    hf = next((x for x in r["results"] if x["backend"] == "hf" and x["ok"]), None)
    probe = ""
    if hf:
        trials = ", ".join(f"batch {t['batch_size']}: {t['output_tokens_per_s']:.1f} output tokens/s"
                           for t in hf["batch_probe"])
        probe = (f"\nHF batch size: {r['hf_batch_selection']}. Probe on the first {hf['probe_requests']} requests: "
                 f"{trials}; chosen {hf['best_batch_size']}. HF computes {hf['generated_tokens']} output positions "
                 f"for the {hf['output_tokens']} requested (each static batch runs to its longest output); only "
                 "the requested ones count.\n")
    peak = r.get("peak_matmul_flops_per_s")
    peaks = r.get("peak_matmul_flops_per_s_by_dtype") or {}
    if peaks:
        peak_text = ("the measured matmul peak of the row's dtype (best of repeated 1024x1024 matmuls in the same "
                     "run, through torch.mm and oneDNN's linear, whichever is faster: "
                     + ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in peaks.items()) + ")")
    elif peak:
        peak_text = (f"{peak / 1e9:.1f} GFLOP/s (best of repeated 1024x1024 fp32 matmuls measured in the same run, "
                     "torch.mm or oneDNN's linear)")
    return (
        "## Offline throughput\n\n" + run_block(r.get("meta")) +
        f"\nWorkload: {wl['kind']}, {wl['num_requests']} requests, prompts {wl.get('input_len_range', '')} "
        f"(mean {wl['mean_prompt_len']:.0f}), outputs {wl.get('output_len_range', '')} (mean {wl['mean_output_len']:.0f}); "
        f"{wl['prompt_tokens']} prompt and {wl['output_tokens']} output tokens; greedy, ignore_eos, token-id prompts.\n\n"
        + table(["engine", "requests/s", "output tok/s", "total tok/s", "peak RSS GiB", "start-up s", "generation s",
                 "MFU", "note"], rows)
        + "\nRatios in parentheses are to pagedllm. Start-up = process spawn to model ready (imports, weights, "
          "KV cache, warm-up). Peak RSS: the backend's process tree, polled every 0.1 s. "
        + (f"MFU = model FLOPs / generation time / {peak_text}; {r['flops_formula']}.\n" if peak or peaks else "\n")
        + (f"\n{r['note']}\n" if r.get("note") else "")
        + probe + f"\n![throughput](img/{img.name})\n"
    )


def _rate_x(rates: list[Any]) -> tuple[list[float], list[str]]:
    finite = [float(x) for x in rates if x != "inf"]
    top = max(finite, default=1.0)
    xs = [float(x) if x != "inf" else top * 2 for x in rates]
    return xs, [str(x) if x != "inf" else "burst" for x in rates]


SERVE_PLOTS = (("output_throughput", None, "output tok/s", "tok/s", False),
               ("ttft_ms", "mean", "mean TTFT", "ms", True),
               ("tpot_ms", "mean", "mean TPOT", "ms", True),
               ("itl_ms", "median", "median ITL", "ms", True),
               ("goodput", None, "goodput", "req/s", False))


def serve_section(reports: list[dict[str, Any]], img: Path, ratios: list[dict[str, Any]] | None = None,
                  draw: bool = True) -> str:
    """Reports of `pagedllm bench serve` (one per server); one plot per metric over request rates."""
    parts = ["## Online serving\n"]
    plt = pyplot() if draw else None
    fig, axes = plt.subplots(1, len(SERVE_PLOTS), figsize=(4 * len(SERVE_PLOTS), 3.6)) if plt else (None, ())
    plotted = False
    for n, r in enumerate(reports):
        if r.get("error"):
            parts.append(f"\n### {r['server']}\n\nNot measured: {r['error']}\n")
            continue
        wl = r["workload"]
        parts.append(f"\n### {r['server']}\n\n" + run_block(r.get("meta")))
        if r.get("server_command"):
            parts.append(f"\nServer: `{checkout_relative(r['server_command'])}`, healthy "
                         f"{fmt(r.get('server_startup_s'))} s after launch, peak RSS "
                         f"{fmt(r.get('server_peak_rss_bytes', 0) / GIB, '.2f')} GiB.\n")
        parts.append(f"\nWorkload: {wl['num_requests']} requests, prompts {wl.get('input_len_range', '')}, outputs "
                     f"{wl.get('output_len_range', '')}, streamed /v1/completions, greedy, ignore_eos.\n\n")
        rows = []
        for m in r["runs"]:
            t, p, e, i = m["ttft_ms"], m["tpot_ms"], m["e2el_ms"], m["itl_ms"]
            rows.append([str(m["request_rate"]), str(m.get("max_concurrency") or "-"), f"{m['completed']}/{m['failed']}",
                         f"{m['request_throughput']:.3f}", f"{m['output_throughput']:.1f}",
                         f"{fmt(t['mean'], '.0f')} / {fmt(t['median'], '.0f')} / {fmt(t['p90'], '.0f')} / {fmt(t['p99'], '.0f')}",
                         f"{fmt(p['mean'], '.0f')} / {fmt(p['median'], '.0f')} / {fmt(p['p90'], '.0f')} / {fmt(p['p99'], '.0f')}",
                         f"{fmt(i['median'], '.0f')} / {fmt(i['p99'], '.0f')}",
                         f"{fmt(e['median'] and e['median'] / 1000, '.1f')} / {fmt(e['p99'] and e['p99'] / 1000, '.1f')}",
                         fmt(m.get("goodput"), ".3f")])
        parts.append(table(["rate/s", "max conc.", "ok/failed", "req/s", "out tok/s", "TTFT ms mean/med/p90/p99",
                            "TPOT ms mean/med/p90/p99", "ITL ms med/p99", "E2E s med/p99", "goodput req/s"], rows))
        if r.get("offline"):
            parts.append(offline_block(r))
        slo = next((m["slo"] for m in r["runs"] if "slo" in m), None)
        if slo:
            parts.append(f"\nGoodput SLOs: TTFT <= {slo['ttft_ms']} ms, TPOT <= {slo['tpot_ms']} ms.\n")
        xs, labels = _rate_x([m["request_rate"] for m in r["runs"]])
        for ax, (key, q, title, unit, log) in zip(axes, SERVE_PLOTS):
            ys = [(m.get(key) if q is None else m[key][q]) for m in r["runs"]]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], "-o", color=f"C{n}", label=r["server"])
            ax.set_xticks(xs, labels)
            ax.set_title(title)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(unit)
            if log:
                ax.set_yscale("log")
        plotted = True
    if ratios:
        parts.append(f"\n### Ratios {ratios[0]['servers']} (same run, same workload)\n\n")
        keys = ("output_throughput", "mean_ttft", "mean_tpot", "median_itl", "goodput", "peak_rss")
        parts.append(table(["rate/s", "out tok/s", "mean TTFT", "mean TPOT", "median ITL", "goodput", "peak RSS"],
                           [[str(r["request_rate"]), *(fmt(r[k], ".2f") for k in keys)] for r in ratios]))
        parts.append("\nThroughput and goodput: higher is better for the first server; latency and RSS: lower.\n")
    if plotted:
        if plt:
            axes[0].legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(img, dpi=120)
        parts.append(f"\n![serving: throughput, TTFT, TPOT, ITL, goodput per request rate](img/{img.name})\n")
    if plt:
        plt.close(fig)
    return "".join(parts)


def repeat_section(s: dict[str, Any]) -> str:
    """A `bench serve --repeat N` run: each round's figures and ratios, and their medians."""
    summary = s["summary"]
    first = s["rounds"][0]["servers"][0]
    names = " and ".join(f"`{r.get('server', '')}`" for r in s["rounds"][0]["servers"])
    parts = [f"\n### {summary['rounds']} rounds of {names}\n\n",
             run_block(first.get("meta")),
             "\nEach round launches the server(s) afresh on the same workload (later rounds alternate the order), "
             "then the offline engine where asked.\n\n"]
    if summary["offline_ratio"]:
        offline = [r["servers"][0]["offline"].get("output_tokens_per_s") for r in s["rounds"]]
        served = [r["servers"][0]["runs"][-1]["output_throughput"] for r in s["rounds"]]
        parts.append(table(["rate/s", "server/offline output tok/s per round", "median"],
                           [[str(x["request_rate"]), ", ".join(f"{v:.2f}" for v in x["per_round"]),
                             f"**{x['median']:.2f}**"] for x in summary["offline_ratio"]]))
        parts.append("\nServer / offline output tok/s per round (last rate): "
                     + ", ".join(f"{a:.1f} / {fmt(b, '.1f')}" for a, b in zip(served, offline)) + ".\n")
    if summary["ratios"]:
        for rate_i, x in enumerate(summary["ratios"]):
            cells = [" / ".join(fmt(srv["runs"][rate_i]["output_throughput"] if len(srv.get("runs", [])) > rate_i
                                    else None, ".1f") for srv in r["servers"]) for r in s["rounds"]]
            parts.append(f"\nOutput tok/s ({x['servers']}) at rate {x['request_rate']}, per round: "
                         + ", ".join(cells) + ".\n")
        keys = (("output_throughput", "out tok/s"), ("mean_ttft", "mean TTFT"), ("mean_tpot", "mean TPOT"))
        parts.append(f"\n{summary['ratios'][0]['servers']} per round (median):\n\n")
        parts.append(table(["rate/s", *(k[1] for k in keys)],
                           [[str(x["request_rate"]), *(", ".join(fmt(v, ".2f") for v in x[k]["per_round"])
                                                       + f" (**{fmt(x[k]['median'], '.2f')}**)" for k, _ in keys)]
                            for x in summary["ratios"]]))
    if s.get("note"):
        parts.append(f"\n{s['note']}\n")
    return "".join(parts)


def offline_block(r: dict[str, Any]) -> str:
    """The offline engine on the serve run's workload (`--offline-baseline`) and the server's ratio to it."""
    off = r["offline"]
    if off.get("error"):
        return f"\nOffline engine on the same workload: not measured ({off['error']}).\n"
    rows = [[str(x["request_rate"]), f"{x['output_throughput']:.2f}", "yes" if x["exact_tokens"] else "no"]
            for x in r.get("offline_ratio", [])]
    return (f"\nThe offline engine on the same workload, right after the server stopped (`LLM.generate` in a fresh "
            f"process, {off['dtype']}, engine flags: `{off['engine_flags'] or 'defaults'}`): "
            f"{off['output_tokens_per_s']:.1f} output tok/s ({off['output_tokens']} tokens in "
            f"{off['elapsed_s']:.1f} s). Server over offline:\n\n"
            + table(["rate/s", "server/offline output tok/s", "same token count"], rows)
            + (f"\n{r['note']}\n" if r.get("note") else ""))


def latency_matrix_table(m: dict[str, Any]) -> str:
    """pagedllm and its peers per dtype: prefill (time to first token), decode tok/s, roofline."""
    from pagedllm.benchmarks.latency import peers_of, speedup_round_lines

    rows = []
    for run in m["runs"]:
        r = run["pagedllm"]
        rows.append([run["dtype"], "pagedllm", f"{r['prefill_ms']:.1f}",
                     f"{100 * r['prefill_fraction_of_peak_flops']:.0f}%", f"{r['decode_tokens_per_s']:.1f}",
                     f"{100 * r['decode_weight_fraction_of_peak_bw']:.0f}%", "1.00x / 1.00x"])
        for peer, p in peers_of(run):
            if not p["ok"]:
                rows.append([run["dtype"], peer, "skipped: " + p["reason"].replace("|", "/"), "", "", "", ""])
                continue
            rows.append([run["dtype"], peer, f"{p['prefill_ms']:.1f}", "-", fmt(p.get("decode_tokens_per_s")),
                         f"{100 * p['decode_weight_fraction_of_peak_bw']:.0f}%"
                         if p.get("decode_weight_fraction_of_peak_bw") is not None else "-",
                         f"{p['pagedllm_prefill_speedup']:.2f}x / {fmt(p.get('pagedllm_decode_speedup'), '.2f')}x"])
    first = m["runs"][0]["pagedllm"]
    rounds = ""
    if m.get("repeat", 1) > 1:
        rounds = (f"\n{m['repeat']} rounds, pagedllm first in the odd rounds and last in the even ones: each engine's "
                  "row is its median round (by decode time), each speed-up the median of the per-round ratios, "
                  "which were:\n\n" + "".join(f"- {line}\n" for line in speedup_round_lines(m)))
    return (run_block(first.get("meta")) +
            f"\nOne request, prompt {m['input_len']} tokens, output {m['output_len']} tokens, median of "
            f"{m['num_iters']} runs; copy peak {first['peak_copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul peak per dtype "
            + ", ".join(f"{run['dtype']} {run['pagedllm']['peak_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s" for run in m["runs"])
            + ". Weight roofline = bytes of weights one decode step reads / copy peak. Speed-up = peer time / "
            "pagedllm time (prefill / decode); '-' where the peer's decode was too short to time.\n\n"
            + table(["dtype", "engine", "prefill (TTFT) ms", "prefill % of the dtype's matmul peak", "decode tok/s",
                     "of weight roofline", "pagedllm speed-up"], rows) + rounds
            + (f"\n{m['note']}\n" if m.get("note") else ""))


def kv_quality_section(q: dict[str, Any]) -> str:
    rows = [[r["dtype"], r["kv_cache_dtype"] + (" (calculated scales)" if r["calculate_kv_scales"] else " (scale 1.0)"),
             f"{r['exact_sequences']}/{r['num_prompts']}", f"{100 * r['mean_agreement']:.1f}%",
             f"{r['mean_abs_delta_logprob']:.4f}", f"{r['max_abs_delta_logprob']:.3f}"] for r in q["rows"]]
    rec = q.get("meta") or {}
    where = (f"Machine: {machine(rec)}. Commit {rec['commit']} (the commit that added the results; the run recorded "
             f"none), {rec.get('time', '?')}.\n") if rec.get("commit") else ""
    return ("## KV cache dtype: correctness cost\n\n```\npagedllm bench kv-quality "
            "--dtype bfloat16 --calculate-kv-scales --output-json benchmarks/results/kv_cache_dtype_quality.json\n```\n"
            + where +
            "Greedy decoding of the 64 HF correctness prompts (chat template, 32 tokens) with each cache dtype "
            "against the model dtype's own cache; agreement = tokens before the first difference; |Δlogprob| of the "
            "same chosen token while the runs agree.\n\n"
            + table(["model dtype", "KV cache", "identical sequences", "mean agreement", "mean abs Δlogprob",
                     "max abs Δlogprob"], rows))


def latency_section(r: dict[str, Any]) -> str:
    if r.get("benchmark") == "latency_matrix":
        return "## Single-request latency\n\n" + latency_matrix_table(r)
    g = 1e9
    rows = [
        ["prefill", f"{r['prefill_ms']:.1f} ms", f"{r['prefill_flops_per_s'] / g:.1f} GFLOP/s "
         f"({100 * r['prefill_fraction_of_peak_flops']:.0f}% of peak)", "-"],
        ["decode, per token", f"{r['decode_ms_per_token']:.2f} ms ({r['decode_tokens_per_s']:.1f} tok/s)",
         f"{r['decode_flops_per_s'] / g:.1f} GFLOP/s ({100 * r['decode_fraction_of_peak_flops']:.0f}% of peak)",
         f"{r['decode_weight_bandwidth'] / g:.2f} GB/s weights ({100 * r['decode_weight_fraction_of_peak_bw']:.0f}% of "
         f"peak); {r['decode_weight_kv_bandwidth'] / g:.2f} GB/s with KV"],
    ]
    return (
        "## Single-request latency\n\n" + run_block(r.get("meta")) +
        f"\nOne request, prompt {r['input_len']} tokens, output {r['output_len']} tokens, median of {r['num_iters']} "
        f"runs. Peaks measured in the same run (best of repeated runs): 1024x1024 fp32 matmul {r['peak_matmul_flops_per_s'] / g:.1f} GFLOP/s; "
        f"256 MiB tensor copy {r['peak_copy_bytes_per_s'] / g:.1f} GB/s (bytes read + written). A decode step reads "
        f"{r['model']['decode_weight_bytes'] / 1e6:.0f} MB of weights (decoder + lm_head, {r['model']['dtype']}).\n\n"
        + table(["phase", "time", "compute", "bandwidth"], rows)
        + f"\nWhole request: {r['request_latency_s']:.2f} s.\n"
    )


_NATIVE_DECODE_TEAM = (
    "The call runs in one OpenMP team: each thread takes an equal share of every GEMM's rows (equal weight bytes) "
    "and of SiLU*mul, a share of about equal keys of the (row, KV head) attention items, normalizes the residual "
    "stream for itself, and waits at a barrier only where the next op reads what other threads wrote (five per "
    "layer, one before the greedy argmax); with quantized layers the step runs on the calling thread and each "
    "kernel opens its own team. ")


def native_decode_section(r: dict[str, Any]) -> str:
    head = all("fused_head_ms" in x for x in r["results"])  # runs before the column existed have none
    rows = [[x["dtype"], str(x["rows"]), f"{x['fused_ms']:.2f}", *([fmt(x["fused_head_ms"], ".2f")] if head else []),
             f"{x['torch_ms']:.2f}", f"{x['speedup']:.2f}x", f"{x['fused_weight_gb_s']:.1f}"] for x in r["results"]]
    return (
        "## Decode steps as one native call\n\n" + run_block(r.get("meta")) + "\n"
        "A decode-only step of a few rows runs the whole decoder stack in one C call "
        "(pagedllm/native/csrc/llama_decode.c) instead of about 80 torch ops per layer. "
        f"{_NATIVE_DECODE_TEAM}Step time of each path on "
        f"the same runner, weights and KV cache ({r['context']} tokens of context per row), fastest of 15; the copy "
        f"bandwidth of this machine measured in the same run is {r['copy_bytes_per_s'] / 1e9:.1f} GB/s. The fused "
        "step takes batches up to the row count where it stops winning, per dtype (`DTYPE_ROWS` in "
        "pagedllm/worker/native_decode.py; the LM head's rows stop at the small-M kernel's limit). Weights GB/s counts every parameter once (the tied embedding / LM "
        "head included, which the step reads only for its embedding rows).\n\n"
        + table(["dtype", "rows", "fused ms", *(["fused + LM head ms"] if head else []), "torch ops ms", "speedup",
                 "weights GB/s (fused)"], rows)
        + (f"\n{r['note']}\n" if r.get("note") else "")
    )


def scheduler_section(r: dict[str, Any]) -> str:
    rows = [[str(x["num_running"]), str(x.get("num_waiting", 1)), f"{x['schedule_us']:.0f}", f"{x['update_us']:.0f}", f"{x['step_us_mean']:.0f}",
             f"{x['step_us_median']:.0f}", f"{x['step_us_p99']:.0f}", f"{x['us_per_request']:.1f}",
             fmt(x.get("model_step_ms"), ".1f"),
             f"{100 * x['fraction_of_model_step']:.2f}%" if "fraction_of_model_step" in x else "-"]
            for x in r["results"]]
    return (
        "## Scheduler overhead\n\n" + run_block(r.get("meta")) +
        "\n`schedule()` + `update_from_output()` per step with a fake model, at a steady number of running "
        "requests (finished ones replaced at once; prompts 32-512, outputs 16-256 tokens; prefix caching on) "
        "and of waiting ones.\n\n"
        + table(["running", "waiting", "schedule µs", "update µs", "step µs mean", "median", "p99", "µs per request",
                 "model step ms", "share of model step"], rows)
        + (f"\nModel step: {r['model_step_source']}.\n" if r.get("model_step_source") else "")
        + (f"\n{r['note']}\n" if r.get("note") else "")
    )


def memory_section(r: dict[str, Any], img: Path, draw: bool = True) -> str:
    res = r["results"]
    rows = [[str(x["block_size"]), f"{100 * x['paged_utilization']:.1f}%", f"{100 * x['paged_waste']:.1f}%",
             f"{100 * x['contiguous_oracle_waste']:.1f}%", f"{100 * x['contiguous_max_len_waste']:.1f}%",
             f"{x['mean_batch_size']:.1f}", str(x["preemptions"])] for x in res]
    bs = [x["block_size"] for x in res]
    if draw:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ax.plot(bs, [100 * x["paged_waste"] for x in res], "-o", label="paged (blocks)")
        ax.plot(bs, [100 * x["contiguous_oracle_waste"] for x in res], "--", label="contiguous, prompt + max_tokens")
        ax.plot(bs, [100 * x["contiguous_max_len_waste"] for x in res], ":", label=f"contiguous, max_model_len={r['max_model_len']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("KV slots reserved but empty (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
        ax.set_title("KV cache waste")
        fig.tight_layout()
        fig.savefig(img, dpi=120)
        plt.close(fig)
    wl = r["workload"]
    return (
        "## KV cache memory\n\n" + run_block(r.get("meta")) +
        f"\nSimulation with the real scheduler and KV cache manager (fake model, prefix caching off): "
        f"{wl['num_prompts']} requests, prompts {wl['input_len_range']}, outputs {wl['output_len_range']}, a cache of "
        f"{r['num_kv_tokens']} tokens. Utilization = tokens stored / KV slots reserved, summed over all steps. The "
        f"contiguous columns reserve, for the same running requests, prompt + max_tokens (knowing each output length) "
        f"or max_model_len = {r['max_model_len']}; a contiguous cache of this size could hold only "
        f"{r['contiguous_max_concurrency']} requests at max_model_len, against the mean batch below.\n\n"
        + table(["block size", "paged utilization", "paged waste", "contiguous waste (prompt+max_tokens)",
                 f"contiguous waste (max_model_len)", "mean batch", "preemptions"], rows)
        + (f"\n{r['note']}\n" if r.get("note") else "")
        + f"\n![KV waste](img/{img.name})\n"
    )


