"""Scheduling benchmarks: prefix caching, policies under a mixed workload, recompute versus swap.

    .venv/bin/pagedllm bench scheduling [--quick] [--threads N] [--only NAME ...]

Runs on the embedded default model (SmolLM2-135M, fp32), prints one table per benchmark and writes
everything to benchmarks/results/bench_scheduling[_quick].json.

1. shared_prefix: N requests behind one long system prompt with short unique suffixes; throughput
   and time to first token with the prefix cache on and off.
2. mixed: many short requests queued behind a few very long prompts; mean and p99 latency of the
   short ones under fcfs, srtf, fair (short and long requests from different users) and fcfs
   with --long-prefill-token-threshold.
3. preemption: the cost of one preemption by recompute (a prefill of the victim's tokens, less
   the fixed cost of a one-token request) and by swap (its blocks out to the host pool and back),
   by sequence length, with the break-even length; then a KV pool too small for a batch of
   growing requests, run with recompute, swap and auto preemption: the difference in time per
   preemption between the modes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import statistics
import time
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.script import RESULTS, ROOT, parser

BLOCK = 16


def token_prompt(rng: random.Random, n: int) -> list[int]:
    """n random ordinary token ids (no special tokens)."""
    return [rng.randint(1000, 40000) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    cells = [header] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def timed_generate(llm: LLM, prompts: list, params: list[SamplingParams] | SamplingParams, **kw: Any):
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)
    return outs, time.perf_counter() - t0


# ---- 1. shared prefix --------------------------------------------------------------------------


def bench_shared_prefix(quick: bool) -> dict[str, Any]:
    rng = random.Random(0)
    n, prefix_len, out_len = (16, 200, 16) if quick else (64, 400, 32)
    system = token_prompt(rng, prefix_len)
    prompts = [system + token_prompt(rng, rng.randint(8, 24)) for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM(enable_prefix_caching=caching, max_model_len=1024, block_size=BLOCK,
                  kv_cache_memory=1 << 30, max_num_batched_tokens=2048)
        llm.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
        outs, elapsed = timed_generate(llm, prompts, params)
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        stats = llm.llm_engine.scheduler.get_stats()
        runs["on" if caching else "off"] = {
            "elapsed_s": elapsed,
            "output_tok_per_s": n * out_len / elapsed,
            "total_tok_per_s": (sum(map(len, prompts)) + n * out_len) / elapsed,
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p99_s": percentile(ttft, 99),
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
            "prefix_cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        }
        del llm
    speedup = runs["on"]["output_tok_per_s"] / runs["off"]["output_tok_per_s"]
    table(
        f"Shared prefix: {n} requests, {prefix_len}-token system prompt, 8-24-token suffixes, {out_len} output tokens",
        ["prefix cache", "time (s)", "output tok/s", "total tok/s", "mean TTFT (s)", "p99 TTFT (s)", "hit rate"],
        [[k, r["elapsed_s"], r["output_tok_per_s"], r["total_tok_per_s"], r["ttft_mean_s"], r["ttft_p99_s"],
          r["prefix_cache_hit_rate"]] for k, r in runs.items()],
    )
    print(f"\nthroughput with caching on / off: {speedup:.2f}x")
    return {"workload": {"requests": n, "prefix_tokens": prefix_len, "output_tokens": out_len},
            "runs": runs, "speedup": speedup}


# ---- 2. mixed workload under each policy ---------------------------------------------------------


def bench_mixed(quick: bool) -> dict[str, Any]:
    rng = random.Random(1)
    n_long, long_len, n_short = (2, 512, 16) if quick else (4, 1536, 48)
    longs = [token_prompt(rng, long_len) for _ in range(n_long)]
    shorts = [token_prompt(rng, rng.randint(8, 32)) for _ in range(n_short)]
    prompts = longs + shorts  # the long prompts are queued first
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    users = ["batch"] * n_long + [f"chat{i % 4}" for i in range(n_short)]
    configs = {
        "fcfs": {"scheduling_policy": "fcfs"},
        "srtf": {"scheduling_policy": "srtf"},
        "fair": {"scheduling_policy": "fair"},
        "fcfs + long-prefill threshold 64": {"scheduling_policy": "fcfs", "long_prefill_token_threshold": 64},
    }
    runs = {}
    for name, cfg in configs.items():
        llm = LLM(max_model_len=2048, block_size=BLOCK, kv_cache_memory=1 << 30, max_num_batched_tokens=256,
                  max_num_seqs=4, enable_prefix_caching=False, **cfg)
        llm.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
        outs, elapsed = timed_generate(llm, prompts, params, user=users)
        lat = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
        short_lat, long_lat = lat[n_long:], lat[:n_long]
        runs[name] = {
            "elapsed_s": elapsed,
            "short_mean_s": statistics.mean(short_lat),
            "short_p99_s": percentile(short_lat, 99),
            "long_mean_s": statistics.mean(long_lat),
        }
        del llm
    table(
        f"Mixed: {n_short} short requests (8-32 tokens) behind {n_long} prompts of {long_len} tokens, "
        "16 output tokens each, 256-token step budget, 4 sequences at a time",
        ["policy", "short mean (s)", "short p99 (s)", "long mean (s)", "total (s)"],
        [[k, r["short_mean_s"], r["short_p99_s"], r["long_mean_s"], r["elapsed_s"]] for k, r in runs.items()],
    )
    return {"workload": {"long": n_long, "long_tokens": long_len, "short": n_short}, "runs": runs}


# ---- 3. recompute versus swap --------------------------------------------------------------------


def bench_preemption(quick: bool) -> dict[str, Any]:
    rng = random.Random(2)
    llm = LLM(max_model_len=2048, block_size=BLOCK, kv_cache_memory=1 << 30, enable_prefix_caching=False,
              preemption_mode="auto", swap_space=1.0, max_num_batched_tokens=2048)
    engine = llm.llm_engine
    runner = engine.executor.runner
    costs = engine.preemption_costs
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
    lengths = [64, 256, 1024] if quick else [32, 64, 128, 256, 512, 1024, 2000]
    reps = 2 if quick else 3
    # Fixed cost of a request (scheduling, sampling over the vocabulary), left out of the recompute.
    fixed = min(timed_generate(llm, [token_prompt(rng, 1)], one)[1] for _ in range(reps))
    rows, per_len = [], []
    for n in lengths:
        prompt = token_prompt(rng, n)
        recompute = max(min(timed_generate(llm, [prompt], one)[1] for _ in range(reps)) - fixed, 1e-6)
        nb = -(-n // BLOCK)
        pairs = [(i, i) for i in range(nb)]

        def swap() -> None:
            runner.kv.move_blocks(swap_out=pairs)
            runner.kv.move_blocks(swap_in=pairs)

        swap()
        t0 = time.perf_counter()
        for _ in range(5):
            swap()
        swap_s = (time.perf_counter() - t0) / 5
        per_len.append({"tokens": n, "blocks": nb, "recompute_s": recompute, "swap_s": swap_s,
                        "model_recompute_s": costs.recompute_seconds(n), "model_swap_s": costs.swap_seconds(nb)})
        rows.append([n, recompute * 1e3, swap_s * 1e3, recompute / swap_s,
                     costs.recompute_seconds(n) * 1e3, costs.swap_seconds(nb) * 1e3])
    table(
        "Cost of one preemption by sequence length (recompute = prefill of the tokens; swap = blocks out and back)",
        ["tokens", "recompute (ms)", "swap (ms)", "recompute / swap", "model recompute (ms)", "model swap (ms)"],
        rows,
    )
    cheaper = [r["tokens"] for r in per_len if r["recompute_s"] < r["swap_s"]]
    measured_break_even = max(cheaper) if cheaper else 0
    print(f"\nmeasured {costs.flops_per_second / 1e9:.1f} GFLOP/s, {costs.copy_bytes_per_second / 1e9:.2f} GB/s "
          f"block copies; fixed cost of a request {fixed * 1e3:.0f} ms. Break-even (swap cheaper above): "
          f"cost model {costs.break_even_tokens(BLOCK):.0f} tokens, measured "
          + (f"{measured_break_even} tokens" if cheaper else "0 tokens (swap is cheaper at every length)"))

    # End to end: requests that grow until the pool cannot hold them all, in each mode.
    n_req, plen, olen = (6, 32, 96) if quick else (12, 64, 192)
    prompts = [token_prompt(rng, plen) for _ in range(n_req)]
    params = SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True)
    tight_blocks = 5 * -(-(plen + olen) // BLOCK) // 2  # about 2.5 requests at full length
    e2e = {}
    for label, kw in {
        "roomy": {"kv_cache_memory": 1 << 30},
        "recompute": {"num_kv_blocks": tight_blocks, "preemption_mode": "recompute"},
        "swap": {"num_kv_blocks": tight_blocks, "preemption_mode": "swap", "swap_space": 0.5},
        "auto": {"num_kv_blocks": tight_blocks, "preemption_mode": "auto", "swap_space": 0.5},
    }.items():
        e = LLM(max_model_len=1024, block_size=BLOCK, enable_prefix_caching=False, max_num_batched_tokens=512,
                max_num_seqs=n_req, **kw)
        e.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
        outs, elapsed = timed_generate(e, prompts, params)
        s = e.llm_engine.scheduler.get_stats()
        e2e[label] = {"elapsed_s": elapsed, "preemptions": s.num_preemptions,
                      "by_mode": s.num_preemptions_by_mode, "tokens": [o.outputs[0].token_ids for o in outs]}
        del e
    rows = []
    for label, r in e2e.items():
        r["same_tokens_as_roomy"] = r["tokens"] == e2e["roomy"]["tokens"]
        rows.append([label, r["elapsed_s"], r["preemptions"], json.dumps(r["by_mode"]), r["same_tokens_as_roomy"]])
    for r in e2e.values():
        del r["tokens"]
    table(
        f"End to end: {n_req} requests of {plen} + {olen} tokens in {tight_blocks} blocks (about 2.5 requests "
        "at full length) and in a roomy pool",
        ["pool / mode", "time (s)", "preemptions", "by mode", "same greedy tokens"],
        rows,
    )
    rec, swp = e2e["recompute"], e2e["swap"]
    n_pre = max(rec["preemptions"], swp["preemptions"], 1)
    extra = (rec["elapsed_s"] - swp["elapsed_s"]) / n_pre
    print(f"\nrecompute - swap: {extra * 1e3:.0f} ms per preemption ({rec['preemptions']} vs {swp['preemptions']} "
          "preemptions); the smaller batches of the tight pool cost the rest of the gap to roomy")
    return {
        "rates": {"flops_per_s": costs.flops_per_second, "copy_bytes_per_s": costs.copy_bytes_per_second},
        "fixed_request_s": fixed,
        "cost_model_break_even_tokens": costs.break_even_tokens(BLOCK),
        "measured_break_even_tokens": measured_break_even,
        "per_length": per_len,
        "end_to_end": e2e,
        "recompute_minus_swap_s_per_preemption": extra,
    }


BENCHES = {"shared_prefix": bench_shared_prefix, "mixed": bench_mixed, "preemption": bench_preemption}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--quick", action="store_true", help="small workloads: checks that everything runs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--only", nargs="*", choices=list(BENCHES), default=list(BENCHES))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"quick": args.quick, "torch_threads": torch.get_num_threads(),
                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    try:
        from pagedllm.benchmarks.env import run_metadata

        result["env"] = run_metadata()
    except Exception as exc:  # the shared metadata helper is optional here
        result["env"] = {"error": repr(exc)}
    t0 = time.perf_counter()
    for name in args.only:
        result[name] = BENCHES[name](args.quick)
    result["total_s"] = time.perf_counter() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"bench_scheduling{'_quick' if args.quick else ''}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {path.relative_to(ROOT)} ({result['total_s']:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
