"""Single-request decode while other processes keep the CPU's cores busy, with the fused step's
stall guard (pagedllm/worker/stall_guard.py: StallGuard) off and on.

Usage: .venv/bin/pagedllm bench cpu-contention [--dtype bfloat16] [--tokens 256]
    [--out benchmarks/results/cpu_contention.md]

One engine (default flags, the given dtype) decodes one request of --tokens tokens per case; each
case starts 0, 1 or 2 busy processes (a Python loop each) beside it. "off" pins the guard to the
team of torch's threads (as before it existed); "on" is the default behaviour. Reported: output
tokens/s over the decode steps, and the median, 90th and 99th percentile of a step's time.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pagedllm.benchmarks.env import run_metadata
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.native_decode import StallGuard
from pagedllm.benchmarks.script import parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=None, help="markdown file for the table")
    args = ap.parse_args(argv)
    meta = run_metadata()
    eng = LLMEngine.from_engine_args(EngineArgs(dtype=args.dtype, enable_prefix_caching=False))
    nd = eng.core.executor.runner.native_decode
    if nd is None:
        raise SystemExit("the fused decode step does not run here (see the startup log)")
    team = nd.guard.team
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def decode(i: int) -> np.ndarray:
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(100, 132))}, params)
        steps = []
        while eng.has_unfinished_requests():
            s0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - s0)
        return np.array(steps[1:])  # decode steps (the first is the prefill)

    decode(0)
    rows = []
    for hogs in (0, 1, 2):
        for guard in (False, True):
            procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(hogs)]
            time.sleep(0.3)
            nd.guard = StallGuard(team if guard else 1)
            try:
                s = decode(len(rows) + 1)
            finally:
                for p in procs:
                    p.kill()
            row = (hogs, "on" if guard else "off", 1 / s.mean(), *(1e3 * np.percentile(s, q) for q in (50, 90, 99)),
                   nd.guard.switches)
            rows.append(row)
            print("busy processes %d, guard %-3s: %6.1f tok/s, step median %.1f ms, p90 %.1f, p99 %.1f; switches %d"
                  % row, flush=True)
    lines = [
        "## Decode beside other busy processes (the stall guard)", "",
        "```", f".venv/bin/pagedllm bench cpu-contention --dtype {args.dtype} "
        f"--tokens {args.tokens}", "```", "",
        f"One request of {args.tokens} tokens, {args.dtype}, {team} torch threads, beside 0, 1 or 2 busy "
        f"processes; machine {meta['cpu_model']}, {meta['cpu_cores']} cores; commit {meta['commit']}, "
        f"{meta['time']}. Guard off: the fused step always runs on the team of torch's threads; on: "
        "one thread while the team's recent steps take over twice their usual time on average. Where the guard "
        "made no switch (no busy process) both rows ran the same code: their difference is the host's drift "
        "between runs.", "",
        "| busy processes | guard | tok/s | step median ms | p90 ms | p99 ms | switches to one thread |",
        "|---|---|---|---|---|---|---|",
        *("| %d | %s | %.1f | %.1f | %.1f | %.1f | %d |" % r for r in rows), ""]
    if args.out:
        Path(args.out).write_text("\n".join(lines))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
