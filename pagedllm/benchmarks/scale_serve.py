"""`pagedllm bench scale`'s served part: `pagedllm serve` and `vllm serve` (vLLM's CPU build from the
peers' environment, bf16) launched one after the other on the scale model's folder, each driven by
`pagedllm bench serve`'s client (benchmarks/serve.py: streamed /v1/completions, greedy, ignore_eos)
with the same random request set at each --serve-request-rate (inf: all at once; a finite rate:
Poisson arrivals). Per engine and rate: output tokens/s, mean and p95 TTFT and TPOT; per rate the
speedups of pagedllm over vLLM (output tok/s ours / theirs; latencies theirs / ours: above 1 is
pagedllm ahead). Both servers run with --max-model-len 2048 and seed 0; vLLM's KV cache is
--vllm-kv-cache-space GiB.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENGINES = ("pagedllm", "vllm")
SERVER_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--seed", "0"]
# the latency figures compared, as (name in a run row, key of the serve report's metrics, statistic)
LATENCIES = (("ttft_mean", "ttft_ms", "mean"), ("ttft_p95", "ttft_ms", "p95"),
             ("tpot_mean", "tpot_ms", "mean"), ("tpot_p95", "tpot_ms", "p95"))


def parse_rates(text: str) -> list[float]:
    """--serve-request-rates: 'inf,1' -> [inf, 1.0] (serve.parse_request_rates)."""
    from pagedllm.benchmarks.serve import parse_request_rates

    return parse_request_rates(text, "--serve-request-rates")


def run_row(engine: str, m: dict[str, Any]) -> dict[str, Any]:
    """One engine's figures at one rate, from a `run_serve_bench` run's metrics."""
    row: dict[str, Any] = {"engine": engine, "request_rate": m["request_rate"], "completed": m["completed"],
                           "failed": m["failed"], "errors": m["errors"], "duration_s": m["duration_s"],
                           "output_tokens": m["output_tokens"], "output_tokens_per_s": m["output_throughput"]}
    for name, key, stat in LATENCIES:
        row[f"{name}_ms"] = m[key][stat]
    return row


def _ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or not y else x / y


def serve_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per request rate where both engines ran without failures: pagedllm's speedups over vLLM."""
    by = {(r["engine"], str(r["request_rate"])): r for r in runs}
    out = []
    for rate in dict.fromkeys(str(r["request_rate"]) for r in runs):
        ours, theirs = by.get(("pagedllm", rate)), by.get(("vllm", rate))
        if ours is None or theirs is None or ours["failed"] or theirs["failed"]:
            continue
        row: dict[str, Any] = {"request_rate": ours["request_rate"],
                               "output_speedup_vs_vllm": _ratio(ours["output_tokens_per_s"],
                                                                theirs["output_tokens_per_s"])}
        for name, _, _ in LATENCIES:
            row[f"{name}_speedup_vs_vllm"] = _ratio(theirs[f"{name}_ms"], ours[f"{name}_ms"])
        out.append(row)
    return out


def summarize(reports: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The servers (start-up, peak RSS, command, or why not) and the run rows of each engine's
    `run_serve_bench` report (or {"error": ...} where it could not launch)."""
    servers, runs = [], []
    for engine, rep in reports.items():
        if "error" in rep:
            servers.append({"engine": engine, "ok": False, "reason": rep["error"]})
            continue
        servers.append({"engine": engine, "ok": True, "startup_s": rep.get("server_startup_s"),
                        "peak_rss_bytes": rep.get("server_peak_rss_bytes"), "command": rep.get("server_command")})
        runs += [run_row(engine, m) for m in rep["runs"]]
    return servers, runs


def _launch_and_measure(kind: str, folder: str, reqs: list[Any], info: dict[str, Any], opts: dict[str, Any],
                        args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.env import REPO_ROOT
    from pagedllm.benchmarks.serve import LaunchedServer, LaunchError, run_serve_bench

    env = dict(os.environ)
    if kind == "pagedllm":  # the server runs this checkout's code, whatever the venv's install points at
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_cache_space)
    print(f"--- serve: {kind} ---", file=sys.stderr, flush=True)
    try:
        with LaunchedServer(kind, folder, list(SERVER_ARGS), args.peers_venv, args.launch_timeout, env) as server:
            return run_serve_bench(server.base_url, reqs, info, {**opts, "server_label": kind}, server)
    except LaunchError as exc:
        print(f"serve: cannot launch {kind}: {exc}", file=sys.stderr, flush=True)
        return {"error": str(exc)}


def run_serve_part(folder: str, args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.env import run_metadata
    from pagedllm.benchmarks.workloads import parse_range, random_workload, vocab_info, workload_summary

    rates = parse_rates(args.serve_request_rates)
    in_range = parse_range(args.input_len_range, "--input-len-range")
    out_range = parse_range(args.output_len_range, "--output-len-range")
    reqs = random_workload(args.serve_num_prompts, in_range, out_range, vocab_info(folder), 0)
    info = {"kind": "random", "seed": 0, "input_len_range": list(in_range), "output_len_range": list(out_range)}
    opts = {"sampling": None, "model_name": None, "request_rates": rates, "max_concurrency": None, "seed": 0,
            "api_key": None, "slo_ttft_ms": None, "slo_tpot_ms": None, "request_timeout": 1800.0, "num_warmup": 1}
    engines = [e for e in ENGINES if not (e == "vllm" and args.skip_vllm)]
    reports = {kind: _launch_and_measure(kind, folder, reqs, info, opts, args) for kind in engines}
    servers, runs = summarize(reports)
    ratios = serve_ratios(runs)
    for r in ratios:
        print(f"served at rate {r['request_rate']}: pagedllm / vLLM output tok/s {r['output_speedup_vs_vllm']:.2f}x",
              file=sys.stderr, flush=True)
    return {"meta": run_metadata(), "workload": info | workload_summary(reqs),
            "request_rates": [r if r != float("inf") else "inf" for r in rates], "server_args": " ".join(SERVER_ARGS),
            "vllm_kv_cache_space_gib": args.vllm_kv_cache_space, "servers": servers, "runs": runs, "ratios": ratios}
