"""Runs the server chaos tests many times in a row with different seeds, then one storm of 1,000
random disconnects, and records the outcome in benchmarks/results/chaos_runs.{json,md}.

usage: nice pagedllm bench chaos [--seeds 20] [--first-seed 1] [--disconnects 1000] [--no-write | --note-only]

It times nothing worth a quiet machine (it is the test suite, repeated), so it needs no bench lock.

Each run is `pytest tests/integration/test_server_chaos.py` with PAGEDLLM_CHAOS_SEED set (a real
`pagedllm serve` on the tiny test model: a storm of 300 clients leaving at random moments with
/metrics polls, the engine core killed mid-stream, the server killed under the engine core). The
last run is the storm test alone with PAGEDLLM_CHAOS_REQUESTS=1000: it passes only if the engine
never dies (the same greedy text before and after, /health 200, every KV block free, exit code 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from pagedllm.benchmarks.env import command_line, run_metadata
from pagedllm.benchmarks.report_render import Hosts
from pagedllm.benchmarks.script import RESULTS, ROOT, parser

CHAOS = "tests/integration/test_server_chaos.py"


def run_pytest(seed: int, requests: int | None, only_storm: bool) -> tuple[bool, float, str]:
    env = {**os.environ, "PAGEDLLM_CHAOS_SEED": str(seed), "PYTHONPATH": str(ROOT)}
    if requests is not None:
        env["PAGEDLLM_CHAOS_REQUESTS"] = str(requests)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", CHAOS]
    if only_storm:
        cmd += ["-k", "disconnect_storm"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, time.monotonic() - t0, tail[-1] if tail else ""


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--disconnects", type=int, default=1000, help="requests of the final storm (0: skip it)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    ap.add_argument("--note-only", action="store_true",
                    help="run nothing; make chaos_runs.md again from the chaos_runs.json that is there")
    args = ap.parse_args(argv)
    if args.note_only:
        write(json.loads((RESULTS / "chaos_runs.json").read_text()), RESULTS)
        return

    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        ok, secs, last = run_pytest(seed, None, only_storm=False)
        runs.append({"seed": seed, "passed": ok, "seconds": round(secs, 1), "summary": last})
        print(f"seed {seed}: {'pass' if ok else 'FAIL'} in {secs:.0f} s ({last})", flush=True)
    storm = None
    if args.disconnects:
        seed = args.first_seed + args.seeds
        ok, secs, last = run_pytest(seed, args.disconnects, only_storm=True)
        storm = {"seed": seed, "requests": args.disconnects, "passed": ok, "seconds": round(secs, 1), "summary": last}
        print(f"storm of {args.disconnects} (seed {seed}): {'pass' if ok else 'FAIL'} in {secs:.0f} s ({last})")
    passed = sum(r["passed"] for r in runs)
    print(f"{passed}/{len(runs)} chaos runs passed")
    if args.no_write:
        return
    meta = run_metadata()
    result = {"command": "nice -n 10 " + command_line(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "commit": meta["commit"], "meta": meta, "runs": runs, "storm": storm,
              "load_avg_at_end": [round(x, 1) for x in os.getloadavg()]}
    write(result, RESULTS)
    print(f"wrote {RESULTS / 'chaos_runs.json'} and {RESULTS / 'chaos_runs.md'}")


def write(result: dict, out: Path) -> None:
    """chaos_runs.json, and the page's section chaos_runs.md made from it (`--note-only` makes the
    section again from the JSON that is there)."""
    (out / "chaos_runs.json").write_text(json.dumps(result, indent=1) + "\n")
    runs, storm, meta = result["runs"], result["storm"], result["meta"]
    passed = sum(r["passed"] for r in runs)
    host = Hosts(out).of(meta, "chaos_runs.json")
    seeds = [r["seed"] for r in runs]
    secs = [r["seconds"] for r in runs]
    lines = [
        "## Chaos: seeds in a row, and 1,000 random disconnects",
        "",
        "Host: {} ({}), {}, {} cores. Earlier series: [perf-history.md](perf-history.md#chaos-series).".format(
            meta["cpu_model"], host.get("label", "?"), host.get("isa", "?"), meta["cpu_cores"]),
        "",
        f"```\n{result['command']}\n```",
        "",
        f"The server chaos tests ({CHAOS}: a storm of 300 clients leaving at random moments of their "
        "requests' lives mixed with /metrics and /health polls, the engine core killed mid-stream, the "
        "server killed under the engine core) ran {n} times in a row with seeds {a}..{b}: "
        "**{p}/{n} passed**, {lo:.0f}-{hi:.0f} s per run ({tot:.0f} s in all), run {t}, commit {c}.".format(
            n=len(runs), a=seeds[0] if seeds else "-", b=seeds[-1] if seeds else "-", p=passed,
            lo=min(secs, default=0), hi=max(secs, default=0), tot=sum(secs), t=result["time"], c=result["commit"]),
    ]
    failed = [str(r["seed"]) for r in runs if not r["passed"]]
    if failed:
        lines.append(f"Failed seeds: {', '.join(failed)}.")
    if storm is not None:
        lines += ["", f"A storm of **{storm['requests']} requests** (seed {storm['seed']}) with random disconnects "
                  f"under load: {'passed, zero engine deaths' if storm['passed'] else 'FAILED'} "
                  f"({storm['seconds']:.0f} s; the test checks /health 200, the same greedy text before and "
                  "after, every KV block free and the scheduler's integrity check after every step)."]
    (out / "chaos_runs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
