"""The measurements behind docs/benchmarks.md, one after another, then the report.

Run on a quiet machine (`uptime` load average below 0.5) with nothing else running; with
OMP_NUM_THREADS unset every engine uses all cores. `make peers` first for the vLLM rows.
--prefix amx_ (or avx2_, ...) names the result files for a host other than the AVX-512 BF16 EPYC
the unprefixed files come from; benchmarks/results/hosts.json maps file names to hosts. Run from a
committed tree: a run from a tree with uncommitted changes is reported as not citable.
Approximate times on 2 cores: throughput 40-60 min (hf ~25, vllm ~15 incl. start-up), serve ~60 min,
latency 4 min, nativedecode 2 min, prefill 5 min, kvquality 3 min, scheduler 2 min, memory 10 s.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from pagedllm.benchmarks.script import RESULTS, ROOT, parser

WORKLOAD = "--num-prompts 48 --input-len-range 32:512 --output-len-range 16:256"
# step -> the `pagedllm bench` commands it runs ({R}: the results folder, {P}: the prefix); a
# command marked `True` may fail without stopping the run (a peer that does not start).
STEPS: dict[str, list[tuple[str, bool]]] = {
    "throughput": [("throughput --num-prompts 128 --input-len-range 32:512 --output-len-range 16:256 "
                    "--dtype float32,bfloat16 --compare hf,vllm --output-json {R}/{P}throughput.json", False)],
    # Both servers on their default dtype, one after the other on the same workload, in one run; then
    # the targets' rates again, 3 rounds in alternating order (about 22 min), and the server against
    # the offline engine, 5 rounds (about 6 min): medians that one run on a drifting host cannot give.
    "serve": [(f"serve --launch pagedllm,vllm {WORKLOAD} --request-rate 0.5,1,2,inf --slo-ttft 5000 "
               "--slo-tpot 500 --output-json {R}/{P}serve.json", True),
              (f"serve --launch pagedllm,vllm {WORKLOAD} --request-rate 0.5,inf --repeat 3 --slo-ttft 5000 "
               "--slo-tpot 500 --output-json {R}/{P}serve-vllm-rounds.json", True),
              ("serve --launch pagedllm --label 'pagedllm server vs offline engine' --offline-baseline --repeat 5 "
               f"{WORKLOAD} --request-rate inf --output-json {{R}}/{{P}}serve-offline.json", True)],
    "latency": [("latency --input-len 32 --output-len 128 --num-iters 3 --dtype float32,bfloat16 "
                 "--compare llama.cpp --repeat 5 --output-json {R}/{P}latency.json", False)],
    "nativedecode": [("kernels native-decode --out {R}/{P}native_decode.json", False)],
    "prefill": [("latency --input-len 7000 --output-len 2 --num-iters 1 --num-iters-warmup 0 --max-model-len 8192 "
                 "--dtype float32,bfloat16 --compare hf --output-json {R}/{P}prefill.json", False)],
    # A Llama-3.2-1B-shaped model (random weights): vLLM, llama.cpp (BF16/Q8_0/Q4_0) and HF; about 25 min.
    "scale": [("scale --shape llama-3.2-1b --output-json {R}/{P}scale-llama-3.2-1b.json", True)],
    "kvquality": [("kv-quality --dtype bfloat16 --calculate-kv-scales "
                   "--output-json {R}/{P}kv_cache_dtype_quality.json", False)],
    "scheduler": [("scheduler --num-running 64,256,1024 --num-steps 200 --output-json {R}/{P}scheduler.json", False)],
    "memory": [("memory --block-sizes 8,16,32,64 --num-prompts 256 --num-kv-tokens 65536 --max-model-len 2048 "
                "--output-json {R}/{P}memory.json", False)],
}


def commands(steps: list[str], prefix: str) -> list[tuple[list[str], bool]]:
    """The command lines of `steps` (ValueError naming an unknown step)."""
    bad = [s for s in steps if s not in STEPS]
    if bad:
        raise ValueError(f"unknown step(s) {', '.join(bad)}; choose from {', '.join(STEPS)}")
    results = os.path.relpath(RESULTS, ROOT)
    return [([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench",
              *shlex.split(cmd.format(R=results, P=prefix))], may_fail)
            for step in steps for cmd, may_fail in STEPS[step]]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = parser(__doc__, prog)
    ap.add_argument("steps", nargs="*", metavar="STEP", help=f"steps to run (default all): {', '.join(STEPS)}")
    ap.add_argument("--prefix", default=os.environ.get("PREFIX", ""),
                    help="prefix of the result files' names (default $PREFIX, else none)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    todo = commands(args.steps or list(STEPS), args.prefix)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        subprocess.run(["uptime"], check=False)
    for cmd, may_fail in todo + [([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "report"], False)]:
        print("+ pagedllm " + shlex.join(cmd[3:]), flush=True)
        if not args.dry_run:
            rc = subprocess.run(cmd, cwd=ROOT).returncode
            if rc and not may_fail:
                return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
