"""The system's claims, checked with the simulator (docs/claims.md): runs every experiment, writes
benchmarks/results/sim/claims.json and the plots docs/img/claims-*.png.

    pagedllm bench sim-claims [--only NAME ...]

Every experiment drives pagedllm's real Scheduler / KVCacheManager / policies through
pagedllm.simulator; the hardware is a built-in GPU profile (docs/simulator.md) unless stated.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pagedllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagedllm.simulator.cost_model import CostModel, StepFeatures  # noqa: E402
from pagedllm.simulator.hardware import gpu_profile, load_profile  # noqa: E402
from pagedllm.simulator.model import load_model_config  # noqa: E402
from pagedllm.simulator.report import summarize  # noqa: E402
from pagedllm.simulator.runner import Simulation, kv_blocks_for  # noqa: E402
from pagedllm.simulator.trace import TraceRequest, synthetic_trace  # noqa: E402
from pagedllm.benchmarks.env import run_metadata  # noqa: E402
from pagedllm.benchmarks.script import RESULTS, ROOT, parser  # noqa: E402

IMG = ROOT / "docs" / "img"
OUT = RESULTS / "sim" / "claims.json"
GiB = 1 << 30


def simulate(model, hw, trace, *, tp=1, block_size=16, kv_bytes=None, num_kv_blocks=None, swap_gib=0.0,
             track_tokens=False, **sched):
    max_len = sched.pop("max_model_len", max(r.prompt_len + r.output_len for r in trace))
    sc = SchedulerConfig(max_model_len=max_len, **sched)
    cc = CacheConfig(block_size=block_size, kv_cache_memory=kv_bytes, num_kv_blocks=num_kv_blocks,
                     enable_prefix_caching=False, swap_space=swap_gib)
    cost = CostModel(model, hw, block_size, tp)
    nb = kv_blocks_for(cost, cc, tp, 1, sc.max_num_batched_tokens)
    nswap = int(swap_gib * GiB // (cost.block_bytes / tp)) if sc.preemption_mode != "recompute" else 0
    sim = Simulation(sc, cc, cost, nb, nswap)
    res = sim.run(trace, track_tokens=track_tokens)
    return res, summarize(res.requests, res.sim_elapsed_s, 2.0, 0.1)


def savefig(fig, name):
    IMG.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(IMG / name, dpi=110)
    plt.close(fig)


# ---- 1. paged vs contiguous reservation -------------------------------------------------------
def claim_paged_memory():
    """Contiguous reservation of max_model_len per request = the same scheduler with one block of
    max_model_len tokens per request (block_size = max_model_len)."""
    model, hw = load_model_config("llama3-8b"), gpu_profile("h100")
    trace = synthetic_trace(3000, math.inf, "lognormal:220:0.9:700", "lognormal:180:0.9:320", seed=1)
    out = {}
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, bs in (("paged, block 16", 16), ("contiguous, max_model_len 1024 reserved", 1024)):
        res, s = simulate(model, hw, trace, block_size=bs, kv_bytes=4 * GiB, track_tokens=True,
                          max_num_batched_tokens=4096, max_num_seqs=512, max_model_len=1024)
        tl = res.timeline
        alloc = np.asarray(tl["kv_usage"]) * res.num_kv_blocks * bs
        live = np.asarray(tl["kv_tokens"])
        busy = alloc > 0
        util = live[busy] / alloc[busy]
        # Time-weighted averages over the steps (steps are ~uniform in time under load).
        out[label] = {"mean_utilization": float(util.mean()), "mean_running": float(np.mean(tl["running"])),
                      "output_tok_s": s["output_tok_s"], "elapsed_s": s["elapsed_s"],
                      "kv_capacity_tokens": res.num_kv_blocks * bs}
        ax[0].plot(tl["t"], 100 * live / max(res.num_kv_blocks * bs, 1), lw=1, label=label)
        ax[1].plot(tl["t"], tl["running"], lw=1, label=label)
    ax[0].set(xlabel="simulated time (s)", ylabel="KV slots holding live tokens (%)", ylim=(0, 100),
              title="memory holding K/V")
    ax[1].set(xlabel="simulated time (s)", ylabel="running requests", title="batch size")
    ax[0].legend(fontsize=8)
    savefig(fig, "claims-paged-memory.png")
    return out


# ---- 2. block size 64 vs 16 for long sequences ------------------------------------------------
def claim_block_size():
    from pagedllm.worker.input_batch import RequestState, build_batch

    out = {"block_table": [], "host_build_s": {}, "scheduler_step_s": {}, "sim": {}}
    n_req, ctx = 1024, 16384
    for bs in (16, 64):
        entries = math.ceil((ctx + 1) / bs)  # the decoded token at position ctx opens a new block
        out["block_table"].append({"block_size": bs, "entries_per_request": entries,
                                   "bytes_int32_1024_requests": 4 * entries * n_req})
        # Host-side lookup cost: the real worker's batch builder, 1,024 decodes at 16K context.
        states = [RequestState(str(i), [1] * (ctx + 1), ctx, list(range(i * entries, (i + 1) * entries)), ctx, None)
                  for i in range(n_req)]
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            build_batch(states, [1] * n_req, bs, build_groups=False)
            best = min(best, time.perf_counter() - t)
        out["host_build_s"][bs] = best
    # Real scheduler at > 1,000 concurrent long requests (8 x H200, 8B, TP1 per simulated engine).
    model, hw = load_model_config("llama3-8b"), gpu_profile("h200")
    trace = synthetic_trace(1100, math.inf, "uniform:8192:12288", "const:128", seed=2)
    for bs in (16, 64):
        res, s = simulate(model, hw, trace, block_size=bs, num_kv_blocks=(1100 * 12544) // bs + 8,
                          max_num_batched_tokens=16384, max_num_seqs=1100)
        out["scheduler_step_s"][bs] = res.wall_s / res.num_steps
        out["sim"][bs] = {"output_tok_s": s["output_tok_s"], "mean_tpot_s": s["mean_tpot_s"],
                          "steps": res.num_steps, "wall_s": res.wall_s}
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    bss = ["16", "64"]
    ax[0].bar(bss, [r["bytes_int32_1024_requests"] / 1e6 for r in out["block_table"]])
    ax[0].set(xlabel="block size", ylabel="MB", title="block tables, 1,024 requests x 16K tokens")
    ax[1].bar(bss, [1e3 * out["host_build_s"][b] for b in (16, 64)])
    ax[1].set(xlabel="block size", ylabel="ms", title="worker batch build (real code, this CPU)")
    ax[2].bar(bss, [1e3 * out["scheduler_step_s"][b] for b in (16, 64)])
    ax[2].set(xlabel="block size", ylabel="ms per step", title="real scheduler, 1,100 x 8-12K requests")
    savefig(fig, "claims-block-size.png")
    return out


# ---- 3. chunked prefill: chunk size vs TTFT / TPOT --------------------------------------------
def claim_chunked_prefill():
    model, hw = load_model_config("llama3-8b"), gpu_profile("h100")
    trace = synthetic_trace(3000, 14.0, "lognormal:1500:0.6:6000", "lognormal:200:0.6:600", seed=3)
    rows = []
    for chunk in (256, 512, 1024, 2048, 4096, 8192):
        _, s = simulate(model, hw, trace, max_num_batched_tokens=chunk, max_num_seqs=256)
        rows.append({"chunk": chunk, **{k: s[k] for k in ("output_tok_s", "mean_ttft_s", "p99_ttft_s",
                                                         "mean_tpot_s", "p99_tpot_s", "mean_e2e_s")}})
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    xs = [str(r["chunk"]) for r in rows]
    ax[0].plot(xs, [r["mean_ttft_s"] for r in rows], marker="o", label="mean TTFT")
    ax[0].plot(xs, [r["p99_ttft_s"] for r in rows], marker="o", label="p99 TTFT")
    ax[0].set(xlabel="token budget per step (chunk)", ylabel="s", title="time to first token")
    ax[0].legend()
    ax[1].plot(xs, [1e3 * r["mean_tpot_s"] for r in rows], marker="o", label="mean TPOT")
    ax[1].plot(xs, [1e3 * r["p99_tpot_s"] for r in rows], marker="o", label="p99 TPOT")
    ax[1].set(xlabel="token budget per step (chunk)", ylabel="ms", title="time per output token")
    ax[1].legend()
    savefig(fig, "claims-chunked-prefill.png")
    return rows


def _grouped_bars(ax, rows: dict[str, dict], series: tuple[tuple[str, str], ...], title: str) -> None:
    """Three bars a policy: the `series` (key, label) of each row of `rows`, in seconds."""
    names = list(rows)
    x = np.arange(len(names))
    for j, (k, lab) in enumerate(series):
        ax.bar(x + 0.27 * (j - 1), [rows[n][k] for n in names], 0.27, label=lab)
    ax.set_xticks(x, [n.split(" (")[0] for n in names])
    ax.set(ylabel="s", title=title)
    ax.legend(fontsize=8)


# ---- 4. policies: FIFO starvation, SRTF, time slices, weighted round robin ----------------------
def _policy_trace():
    short = synthetic_trace(1800, 6.0, "lognormal:200:0.5:800", "lognormal:60:0.5:200", seed=4, num_users=0)
    long = synthetic_trace(200, 0.66, "uniform:3000:5000", "uniform:800:1200", seed=5)
    merged = sorted([(r.arrival_s, 0, i, r) for i, r in enumerate(short)] +
                    [(r.arrival_s, 1, i, r) for i, r in enumerate(long)])
    out = []
    for k, (_, is_long, i, r) in enumerate(merged):
        user = "paid" if k % 3 == 0 else "free"
        out.append(TraceRequest(r.arrival_s, r.prompt_len, r.output_len, 0, user))
    return out


def claim_policies():
    model, hw = load_model_config("llama3-8b"), gpu_profile("h100")
    trace = _policy_trace()
    rows = {}
    configs = {
        "fcfs": dict(policy="fcfs"),
        "srtf": dict(policy="srtf"),
        "fair (time slice 10, paid=3 free=1)": dict(policy="fair", time_slice=10, user_weights={"paid": 3.0, "free": 1.0}),
    }
    for name, kw in configs.items():
        res, s = simulate(model, hw, trace, kv_bytes=3 * GiB, swap_gib=32.0, max_num_batched_tokens=2048,
                          max_num_seqs=64, preemption_mode="swap", **kw)
        done = [r for r in res.requests if r.finish_s >= 0]
        short = [r for r in done if r.prompt_len < 2000]
        long = [r for r in done if r.prompt_len >= 2000]
        e2e = lambda rs: [r.finish_s - r.arrival_s for r in rs]  # noqa: E731
        ttft = lambda rs: [r.first_token_s - r.arrival_s for r in rs]  # noqa: E731
        tokens = {u: sum(r.prompt_len + r.output_len for r in done if r.user == u and r.finish_s <= res.sim_elapsed_s / 2)
                  for u in ("paid", "free")}
        rows[name] = {
            "mean_e2e_s": s["mean_e2e_s"], "output_tok_s": s["output_tok_s"],
            "short_mean_ttft_s": float(np.mean(ttft(short))), "short_p99_ttft_s": float(np.percentile(ttft(short), 99)),
            "short_mean_e2e_s": float(np.mean(e2e(short))), "long_mean_e2e_s": float(np.mean(e2e(long))),
            "long_max_ttft_s": float(np.max(ttft(long))),
            "paid_mean_e2e_s": float(np.mean(e2e([r for r in done if r.user == "paid"]))),
            "free_mean_e2e_s": float(np.mean(e2e([r for r in done if r.user == "free"]))),
            "preemptions": res.preemptions_by_mode,
        }
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    _grouped_bars(ax[0], rows, (("short_mean_ttft_s", "short: mean TTFT"), ("short_p99_ttft_s", "short: p99 TTFT"),
                                ("long_max_ttft_s", "long: max TTFT")), "starvation: short vs long requests")
    _grouped_bars(ax[1], rows, (("mean_e2e_s", "all: mean E2E"), ("paid_mean_e2e_s", "paid: mean E2E"),
                                ("free_mean_e2e_s", "free: mean E2E")), "mean latency and weighted share")
    savefig(fig, "claims-policies.png")
    return rows


# ---- 5. swap cost -------------------------------------------------------------------------------
def claim_swap(cpu_profile: str | None):
    cases = [("llama3-8b", "h100", 1), ("llama3-70b", "h100", 8), ("llama3-8b", "a100", 1)]
    ctxs = [256, 512, 1024, 2048, 4096, 8192, 16384]
    out = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mname, hname, tp in cases:
        model, hw = load_model_config(mname), gpu_profile(hname)
        cost = CostModel(model, hw, 16, tp)
        # One direction (swap-out); all TP ranks move their shard in parallel.
        ts = [cost.step_time(StepFeatures(swap_blocks=math.ceil(c / 16))).moves for c in ctxs]
        out[f"{mname} on {tp}x{hname}"] = dict(zip(map(str, ctxs), ts))
        ax.plot(ctxs, [1e3 * t for t in ts], marker="o", label=f"{mname}, {tp} x {hw.name} (model)")
    if cpu_profile and Path(cpu_profile).is_file():
        # The simulator's CPU profile (its rate was measured on the host and commit it was calibrated on).
        hw = load_profile(cpu_profile)
        model = load_model_config("smollm2-135m")
        cost = CostModel(model, hw, 16)
        ts = [cost.step_time(StepFeatures(swap_blocks=math.ceil(c / 16))).moves for c in ctxs]
        out["smollm2-135m, the CPU profile's copy rate"] = dict(zip(map(str, ctxs), ts))
        out["cpu_profile_swap_bytes_per_s"] = hw.swap_bw
        ax.plot(ctxs, [1e3 * t for t in ts], marker="s", label="smollm2-135m fp32, CPU profile (measured)")
        # The engine's own block moves (out to the host pool and back), timed in this run.
        from pagedllm.simulator.calibrate import measure_swap_bw

        rate = measure_swap_bw(None)
        out["swap_bytes_per_s_measured_now"] = rate
        ts = [math.ceil(c / 16) * cost.block_bytes / rate for c in ctxs]
        out["smollm2-135m on this CPU (rate measured in this run)"] = dict(zip(map(str, ctxs), ts))
        ax.plot(ctxs, [1e3 * t for t in ts], marker="^", label="smollm2-135m fp32, this run's host (measured)")
    ax.axhspan(10, 20, color="grey", alpha=0.2, label="claimed 10-20 ms")
    ax.set(xscale="log", yscale="log", xlabel="tokens of the preempted request", ylabel="swap-out time (ms)",
           title="time to swap one request's KV to host")
    ax.legend(fontsize=7)
    savefig(fig, "claims-swap.png")
    return out


# ---- 6. continuous vs static batching -----------------------------------------------------------
def static_batching(model, hw, trace, kv_bytes, max_batch=256):
    """HF-style static batching on the same cost model: requests in arrival order, in batches
    of B (as many as fit a contiguous max-length reservation, at most max_batch); each batch pads
    its prompts to the longest and decodes until its longest output is done, all rows every step."""
    cost = CostModel(model, hw, 16)
    t = 0.0
    out_tokens = 0
    i = 0
    while i < len(trace):
        P = O = 0
        j = i
        while j < len(trace) and j - i < max_batch:
            P2, O2 = max(P, trace[j].prompt_len), max(O, trace[j].output_len)
            if (j - i + 1) * (P2 + O2) * model.kv_bytes_per_token > kv_bytes:
                break
            P, O, j = P2, O2, j + 1
        B = j - i
        t += cost.step_seconds(StepFeatures(num_tokens=B * P, num_seqs=B, num_sampled=B,
                                            prefill_pairs=B * P * (P + 1) // 2))
        for k in range(1, O):
            t += cost.step_seconds(StepFeatures(num_tokens=B, num_seqs=B, num_sampled=B, decode_context=B * (P + k)))
        out_tokens += sum(r.output_len for r in trace[i:j])
        i = j
    return out_tokens / t


def claim_static_batching():
    model, hw = load_model_config("llama3-8b"), gpu_profile("h100")
    kv = 16 * GiB
    rows = []
    for label, plen, olen in (("128-token sequences", "uniform:16:64", "uniform:8:64"),
                              ("512-token sequences", "uniform:64:256", "uniform:32:256"),
                              ("1K-token sequences", "uniform:128:512", "uniform:64:512"),
                              ("4K-token sequences", "uniform:512:2048", "uniform:256:2048")):
        trace = synthetic_trace(1500, math.inf, plen, olen, seed=6)
        _, s = simulate(model, hw, trace, kv_bytes=kv, max_num_batched_tokens=8192, max_num_seqs=256)
        static = static_batching(model, hw, trace, kv)
        rows.append({"workload": label, "continuous_output_tok_s": s["output_tok_s"],
                     "static_output_tok_s": static, "ratio": s["output_tok_s"] / static})
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([r["workload"].split(" ")[0] for r in rows], [r["ratio"] for r in rows])
    ax.axhspan(2, 3, xmin=0, xmax=0.25, color="orange", alpha=0.3, label="claimed 2-3x (128)")
    ax.axhspan(4, 5, xmin=0.75, xmax=1, color="green", alpha=0.3, label="claimed 4-5x (4K)")
    ax.set(ylabel="continuous / static output tok/s", title="continuous (paged) vs static batching, 8B on H100")
    ax.legend(fontsize=8)
    savefig(fig, "claims-static-batching.png")
    return rows


CLAIMS = {
    "paged_memory": claim_paged_memory,
    "block_size": claim_block_size,
    "chunked_prefill": claim_chunked_prefill,
    "policies": claim_policies,
    "swap": lambda: claim_swap(str(RESULTS / "sim" / "profile-cpu.json")),
    "static_batching": claim_static_batching,
}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("--only", nargs="*", default=list(CLAIMS))
    args = ap.parse_args(argv)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    results["meta"] = run_metadata()
    for name in args.only:
        t = time.perf_counter()
        results[name] = CLAIMS[name]()
        print(f"{name}: {time.perf_counter() - t:.1f} s wall", file=sys.stderr)
        print(json.dumps(results[name], indent=1, default=float))
        OUT.parent.mkdir(parents=True, exist_ok=True)
        results["meta"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        OUT.write_text(json.dumps(results, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
