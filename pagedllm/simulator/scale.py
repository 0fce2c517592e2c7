"""Scale of the simulator: a one-hour, one-million-request trace on an 8 x H200 node serving a
70B-shaped model (TP 8), replayed through pagedllm's real scheduler.

    pagedllm bench sim-scale [--requests N] [--profile-top K]

--requests N replays the first N requests of the 1M trace (same arrival rate, 277.8/s) and
reports simulated requests per wall second and per CPU second; --profile-top K also runs
cProfile and lists where the time goes.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import time
from pathlib import Path

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.simulator.runner import run_one
from pagedllm.simulator.hardware import gpu_profile
from pagedllm.simulator.model import load_model_config
from pagedllm.simulator.trace import synthetic_trace
from pagedllm.benchmarks.script import RESULTS, parser

RATE = 1_000_000 / 3600.0
OUT = RESULTS / "sim" / "scale.json"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--profile-top", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    trace = synthetic_trace(1_000_000, RATE, "lognormal:48:0.8:1024", "lognormal:16:0.8:256", seed=0)[: args.requests]
    t_trace = time.perf_counter() - t0
    ea = EngineArgs(max_num_batched_tokens=8192, max_num_seqs=1024, enable_prefix_caching=True, block_size=16,
                    max_model_len=2048)
    model, hw = load_model_config("llama3-70b"), gpu_profile("h200")
    prof = cProfile.Profile() if args.profile_top else None
    c0, w0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    rep = run_one(ea, model, hw, trace, 8, 1, False, 2.0, 0.1)
    if prof:
        prof.disable()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    out = {k: rep[k] for k in ("num_requests", "elapsed_s", "output_tok_s", "total_tok_s", "mean_ttft_s", "p99_ttft_s",
                               "mean_tpot_s", "p99_tpot_s", "num_steps", "num_kv_blocks", "max_waiting",
                               "time_by_term_s")}
    out |= {"wall_s": wall, "cpu_s": cpu, "trace_gen_s": t_trace, "sim_requests_per_wall_s": len(trace) / wall,
            "sim_requests_per_cpu_s": len(trace) / cpu, "steps_per_cpu_s": rep["num_steps"] / cpu,
            "load_avg": list(os.getloadavg()), "trace": "1M requests over 3600 s, Poisson 277.8/s, prompt "
            "lognormal mean 48 (sigma 0.8, max 1024), output lognormal mean 16 (sigma 0.8, max 256)",
            "deployment": "llama3-70b bf16, TP 8 on 8 x H200 (built-in profile)"}
    if prof:
        st = pstats.Stats(prof)
        total = sum(v[2] for v in st.stats.values())
        rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[: args.profile_top]
        out["profile_tottime_share"] = {f"{Path(f).name}:{line}({fn})": v[2] / total for (f, line, fn), v in rows}
    print(json.dumps(out, indent=1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    name = OUT.with_name(f"scale-{args.requests}{'-prof' if prof else ''}.json")
    name.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
