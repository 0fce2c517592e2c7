"""`pagedllm bench collective`: all-reduce latency and bandwidth through gloo and through the
shared-memory path between ranks on this host, and the communication share of a tensor-parallel
decode step on the default model.

The step figure: the collectives a TP=2 decode step issues (timed in two ranks, with the sizes
of the default model) against a TP=1 decode step of the same batch (timed in the engine). The
default model's 9 heads do not split over 2 ranks, so the TP=2 step itself cannot run; its
communication is what TP adds, and its compute is the TP=1 step's halved at best.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import msgspec
import torch

from pagedllm.config import ParallelConfig

DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _rank(rank: int, world: int, port: int, sizes: list[int], decode: dict[str, int] | None, conn: Any) -> None:
    from pagedllm.distributed.collective_bench import time_all_reduce, time_decode_communication
    from pagedllm.distributed.parallel_state import init_parallel_context

    torch.set_num_threads(1)
    ctx = init_parallel_context(ParallelConfig(tensor_parallel_size=world), rank, 1, f"tcp://127.0.0.1:{port}")
    rows = time_all_reduce(ctx, sizes)
    step = time_decode_communication(ctx, **decode) if decode else None
    if rank == 0:
        conn.send_bytes(msgspec.msgpack.encode({"rows": rows, "decode_comm_s": step}))
    ctx.close()


def run_ranks(world: int, sizes: list[int], decode: dict[str, int] | None) -> dict[str, Any]:
    from pagedllm.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, sizes, decode, send), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    result = msgspec.msgpack.decode(recv.recv_bytes())
    for p in procs:
        p.join(timeout=30)
    return result


def tp1_decode_step_s(batch: int, steps: int = 20) -> tuple[float, dict[str, int]]:
    """Median decode step time of the default model at TP=1 with `batch` requests, and its shape."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32", num_kv_blocks=256))
    params = SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(str(i), f"Question {i}: what is the capital of France?", params)
    while engine.scheduler.get_stats().num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    mc = engine.model_config
    shape = {"batch": batch, "hidden": int(mc.hf_config.hidden_size), "num_layers": mc.num_layers,
             "vocab": mc.vocab_size}
    return times[len(times) // 2], shape


def run_collective_bench(world: int = 2, sizes: list[int] | None = None, batch: int = 16,
                         step: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)
    report: dict[str, Any] = {"world_size": world}
    decode = None
    if step:
        report["tp1_step_s"], decode = tp1_decode_step_s(batch)
        report["decode_shape"] = decode
    res = run_ranks(world, sizes or DEFAULT_SIZES, decode)
    report["all_reduce"] = res["rows"]
    if step:
        report["tp2_decode_comm_s"] = res["decode_comm_s"]
        report["comm_share_of_tp1_step"] = res["decode_comm_s"] / report["tp1_step_s"]
    return report


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def format_collective(report: dict[str, Any]) -> str:
    lines = [f"all-reduce of float32 across {report['world_size']} local ranks (median)",
             f"{'size':>7} {'gloo us':>10} {'gloo GB/s':>10} {'shm us':>10} {'shm GB/s':>10} {'gloo/shm':>9}"]
    for r in report["all_reduce"]:
        g = r["gloo_s"]
        s = r.get("shm_s")
        shm = f"{s * 1e6:>10.1f} {r['bytes'] / s / 1e9:>10.2f} {g / s:>8.1f}x" if s else f"{'-':>10} {'-':>10} {'-':>9}"
        lines.append(f"{_size(r['bytes']):>7} {g * 1e6:>10.1f} {r['bytes'] / g / 1e9:>10.2f} {shm}")
    if "tp1_step_s" in report:
        d = report["decode_shape"]
        lines += [
            "",
            f"decode step, default model, batch {d['batch']}: TP=1 step {report['tp1_step_s'] * 1e3:.2f} ms; "
            f"TP=2 collectives ({2 * d['num_layers'] + 1} all-reduces of [{d['batch']}, {d['hidden']}] + logits "
            f"all-gather) {report['tp2_decode_comm_s'] * 1e3:.2f} ms = "
            f"{100 * report['comm_share_of_tp1_step']:.1f}% of the TP=1 step",
        ]
    lines += ["", "projected decode throughput (assumptions in pagedllm/benchmarks/collective.py)",
              format_projection(project(report))]
    return "\n".join(lines)


# ---- projection ---------------------------------------------------------------------------------
# Llama shapes (bf16 weights): parameters, layers, hidden size.
SHAPES = {"8B": (8.0e9, 32, 4096), "70B": (70.6e9, 80, 8192)}
ASSUMPTIONS = {
    "rank_mem_bw": 50e9,       # bytes/s of weight streaming per rank (one rank per NUMA node or socket share)
    "net_bw": 25e9 / 8,        # 25 GbE between machines, bytes/s
    "net_latency": 50e-6,      # per message hop between machines, s
    "batch": 32,               # decoding sequences per step
    "bytes_per_weight": 2,     # bf16
}


def fit_shm(report: dict[str, Any]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the measured shared-memory all-reduce: the smallest
    message's time, and the slope between the smallest and largest message."""
    rows = [r for r in report["all_reduce"] if "shm_s" in r]
    lo, hi = rows[0], rows[-1]
    slope = (hi["shm_s"] - lo["shm_s"]) / max(hi["bytes"] - lo["bytes"], 1)
    return lo["shm_s"], 1.0 / max(slope, 1e-15)


def project(report: dict[str, Any], assumptions: dict[str, float] = ASSUMPTIONS) -> list[dict[str, Any]]:
    """Decode throughput of 8B/70B-shaped Llamas at TP=2/4/8 over 1/2/4 machines.

    step = weights / (tp * per-rank bandwidth)                          (decode is memory-bound)
         + (2 * layers + 1) * all-reduce([batch, hidden] bf16)          (TP's communication)
    all-reduce over r ranks on each of m machines = 2 * shm(n, r)       (reduce, then share, in-host)
         + 2 (m - 1) * net latency + 2 (m - 1) / m * n / net bandwidth  (ring between machines)
    shm(n, r) = measured latency + (r - 1) * n / measured bandwidth.
    """
    a = assumptions
    alpha, beta = fit_shm(report)
    rows = []
    for name, (params, layers, hidden) in SHAPES.items():
        n = a["batch"] * hidden * 2
        for tp in (2, 4, 8):
            for machines in (1, 2, 4):
                if machines > tp:
                    continue
                r = tp // machines
                intra = 2 * (alpha + (r - 1) * n / beta) if r > 1 else 0.0
                inter = (2 * (machines - 1) * a["net_latency"] + 2 * (machines - 1) / machines * n / a["net_bw"]
                         if machines > 1 else 0.0)
                comm = (2 * layers + 1) * (intra + inter)
                compute = params * a["bytes_per_weight"] / (tp * a["rank_mem_bw"])
                step = compute + comm
                rows.append({"model": name, "tp": tp, "machines": machines, "compute_ms": compute * 1e3,
                             "comm_ms": comm * 1e3, "comm_share": comm / step, "tokens_per_s": a["batch"] / step})
    return rows


def format_projection(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | TP | machines | weights ms/step | comm ms/step | comm share | tokens/s (batch 32) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tp']} | {r['machines']} | {r['compute_ms']:.1f} | {r['comm_ms']:.2f} | "
                     f"{100 * r['comm_share']:.0f}% | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)
