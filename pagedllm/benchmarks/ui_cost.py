"""What the web page's engine view costs a loaded server: output tokens/s of `pagedllm serve` under
full load with and without a viewer on the engine feed.

usage: flock /tmp/pagedllm-bench.lock pagedllm bench ui-cost [--rounds 6] [--requests 64]
           [--concurrency 32] [--max-tokens 64] [--viewers 1] [--output-json PATH] [-- extra serve flags]

It launches `pagedllm serve` (the default model unless extra flags are given), then runs `--rounds`
pairs of rounds, in alternating order (off/on, on/off, ...): each round sends `--requests`
completions (`--max-tokens` tokens each with ignore_eos, distinct random-token prompts of
`--prompt-len` tokens, `--concurrency` at a time) and times them; in an "on" round `--viewers`
clients read `GET /v1/engine/state` throughout (parsing every event, as the page does, without
drawing). It prints each round's output tokens/s and the median drop of "on" against "off", the
snapshots the viewers received (about 4 a second), and the feed's own time as a share of the round:
the engine core's time building the snapshots and the API server's time handing them out (each
snapshot carries both). On a machine whose cores other work shares, the throughput figures move by
more than the feed costs from round to round, and the shares are the figures to read. The page's
own drawing runs in the browser, on the viewer's machine, and is not counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pagedllm.benchmarks.env import command_line, run_metadata
from pagedllm.benchmarks.script import parser
from pagedllm.benchmarks.server_probe import served

class Viewer(threading.Thread):
    """Reads the engine feed until stopped, parsing each event's JSON; counts the snapshots."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.snapshots = 0
        self.build_s = 0.0  # the engine core's time building the snapshots received
        self.feed_s = 0.0  # the API server's time handing them out
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=None) as c, c.stream("GET", self.url + "/v1/engine/state") as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        point = json.loads(line[5:]).get("point")
                        if point is None:  # the hello event
                            continue
                        self.snapshots += 1
                        self.build_s += point["build_ms"] / 1000
                        self.feed_s += point["feed_ms"] / 1000
                    if self.stop.is_set():
                        return
        except Exception as e:  # reported, never hides a result
            self.error = f"{type(e).__name__}: {e}"


async def run_round(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one(p: list[int]) -> int:
            async with sem:
                r = await c.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                          "ignore_eos": True, "temperature": 0.8})
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - t0


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--rounds", type=int, default=6, help="pairs of rounds (one without a viewer, one with)")
    ap.add_argument("--requests", type=int, default=64, help="completions per round")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--viewers", type=int, default=1, help="engine-feed readers during an 'on' round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="write the result here (e.g. benchmarks/results/ui_cost.json)")
    ap.add_argument("serve_args", nargs="*", help="extra `pagedllm serve` flags (after --)")
    args = ap.parse_args(argv)
    for name in ("rounds", "requests", "concurrency", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    meta = run_metadata()
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    with served("pagedllm-ui-cost-", ["--disable-uvicorn-access-log", "--disable-log-stats", *args.serve_args]) as (url, _, _):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def prompts() -> list[list[int]]:
            return [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)]

        asyncio.run(run_round(url, model, prompts()[: args.concurrency], 8, args.concurrency))  # warm-up
        for i in range(args.rounds):
            for watched in ((False, True) if i % 2 == 0 else (True, False)):
                viewers = [Viewer(url) for _ in range(args.viewers if watched else 0)]
                for v in viewers:
                    v.start()
                time.sleep(0.5 if watched else 0.0)  # the feed is on before the round starts
                for v in viewers:  # count from the round's start
                    v.snapshots, v.build_s, v.feed_s = 0, 0.0, 0.0
                tokens, secs = asyncio.run(run_round(url, model, prompts(), args.max_tokens, args.concurrency))
                for v in viewers:
                    v.stop.set()
                errors = [v.error for v in viewers if v.error]
                if errors:
                    raise SystemExit(f"a viewer failed: {errors[0]}")
                row = {"round": i, "viewer": watched, "tokens": tokens, "seconds": round(secs, 3),
                       "tokens_per_s": round(tokens / secs, 2),
                       "snapshots_per_s": round(sum(v.snapshots for v in viewers) / max(len(viewers), 1) / secs, 2),
                       # Shares of the round's wall time (one viewer's count: the engine core builds
                       # each snapshot once, for every viewer).
                       "engine_core_share_percent": round(100 * max((v.build_s for v in viewers), default=0) / secs, 3),
                       "api_server_share_percent": round(100 * max((v.feed_s for v in viewers), default=0) / secs, 3)}
                rows.append(row)
                print(f"round {i} {'with' if watched else 'without'} a viewer: {row['tokens_per_s']:.1f} tokens/s"
                      + (f", {row['snapshots_per_s']:.1f} snapshots/s, building them {row['engine_core_share_percent']:.3f}% of "
                         f"the engine core's time, handing them out {row['api_server_share_percent']:.3f}% of the API "
                         "server's" if watched else ""), flush=True)
                time.sleep(0.5)  # the viewers are gone and the engine core's snapshots are off
    off = [r["tokens_per_s"] for r in rows if not r["viewer"]]
    on = [r["tokens_per_s"] for r in rows if r["viewer"]]
    drops = []  # per pair of rounds: 100 * (1 - with / without)
    for a, b in zip(rows[0::2], rows[1::2]):
        with_viewer, without = (a, b) if a["viewer"] else (b, a)
        drops.append(100 * (1 - with_viewer["tokens_per_s"] / without["tokens_per_s"]))
    result = {
        "command": command_line(), **meta,
        "config": {k: v for k, v in vars(args).items() if k not in ("output_json",)},
        "rounds": rows,
        "median_tokens_per_s_without_viewer": statistics.median(off),
        "median_tokens_per_s_with_viewer": statistics.median(on),
        "median_drop_percent": round(statistics.median(drops), 2),
        "drop_percent_by_pair": [round(d, 2) for d in drops],
        "median_engine_core_share_percent": statistics.median(r["engine_core_share_percent"] for r in rows if r["viewer"]),
        "median_api_server_share_percent": statistics.median(r["api_server_share_percent"] for r in rows if r["viewer"]),
    }
    print(f"median: {result['median_tokens_per_s_without_viewer']:.1f} tokens/s without a viewer, "
          f"{result['median_tokens_per_s_with_viewer']:.1f} with; median drop over the pairs "
          f"{result['median_drop_percent']:+.2f}% (pairs: {result['drop_percent_by_pair']}); the feed took "
          f"{result['median_engine_core_share_percent']:.3f}% of the engine core's time and "
          f"{result['median_api_server_share_percent']:.3f}% of the API server's")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.output_json)
