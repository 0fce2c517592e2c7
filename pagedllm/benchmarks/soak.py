"""Soak of `pagedllm serve`: is memory bounded as the start-up log says, and does every request
get exactly what it asked for?

usage: flock /tmp/pagedllm-bench.lock pagedllm bench soak [--rounds 10] [--requests 500]
           [--streams 1000] [--no-write] [-- extra serve flags]

It launches `pagedllm serve` (the default model and flags unless extra flags are given), reads the
engine core's memory bound from the start-up log ("Memory bound of the engine core: X GiB RSS at
most = ..."), then

1. runs `--rounds` rounds of `--requests` streamed completions (distinct random-token prompts of
   `--prompt-len` tokens, `--max-tokens` tokens each with ignore_eos, `--concurrency` at a time),
   printing after each round the RSS of the API server and engine-core processes (and the
   engine's peak during the round) against the bound;
2. opens `--streams` streams at once (ignore_eos, `--stream-max-tokens` each) and checks that every
   one completes with exactly that many tokens (usage.completion_tokens and finish_reason
   "length"), that the engine's RSS stayed under the bound, and that afterwards nothing runs or
   waits and every KV block is free (/metrics).

The result goes to benchmarks/results/soak.json and serve_soak.md (a section of docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import threading
import time
from typing import Any

import httpx
import psutil

from pagedllm.benchmarks.env import command_line, run_metadata
from pagedllm.benchmarks.script import RESULTS, parser
from pagedllm.benchmarks.server_probe import parse_metrics, served, wait_idle

GIB = 1 << 30
BOUND_RE = re.compile(r"Memory bound of the engine core: ([\d.]+) GiB RSS at most = ([\d.]+) GiB now "
                      r"\(weights ([\d.]+) GiB \+ runtime\) \+ ([\d.]+) GiB KV cache \+ ([\d.]+) GiB host swap "
                      r"space .*?\+ ([\d.]+) GiB step workspace")


class PeakRSS:
    """Samples a process's RSS every `interval` seconds on a thread; `take()` returns the peak since the last take."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return max(peak, self.proc.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()


def engine_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """The server's metrics once nothing runs or waits and no KV block is in use."""
    return wait_idle(lambda: parse_metrics(httpx.get(url + "/metrics", timeout=10).text), timeout)


async def one_stream(c: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[int, str | None, float]:
    """Streams one completion; returns (completion tokens per usage, finish reason, seconds)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    tokens, finish = -1, None
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk}")
            for ch in chunk.get("choices") or []:
                finish = ch.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, finish, time.monotonic() - t0


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[tuple]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800, connect=60), limits=limits) as c:
        sem = asyncio.Semaphore(concurrency)

        async def guarded(p: list[int]) -> tuple:
            async with sem:
                return await one_stream(c, p, max_tokens)

        return await asyncio.gather(*(guarded(p) for p in prompts), return_exceptions=True)


def check(results: list[Any], max_tokens: int) -> tuple[int, list[str]]:
    """(exact completions, problems)."""
    problems = []
    exact = 0
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            problems.append(f"request {i}: {type(r).__name__}: {r}")
        elif r[0] != max_tokens or r[1] != "length":
            problems.append(f"request {i}: {r[0]} tokens, finish {r[1]!r} (wanted {max_tokens}, 'length')")
        else:
            exact += 1
    return exact, problems


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=500, help="streamed requests per round")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (distinct random tokens)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=256, help="streams open at once during a round")
    ap.add_argument("--streams", type=int, default=1000, help="streams opened at once after the rounds (0: skip)")
    ap.add_argument("--stream-max-tokens", type=int, default=8)
    ap.add_argument("--stream-prompt-len", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    ap.add_argument("--render", action="store_true", help="only rewrite serve_soak.md from soak.json")
    ap.add_argument("serve_args", nargs="*", help="extra `pagedllm serve` flags (after --)")
    args = ap.parse_args(argv)
    if args.render:
        out = RESULTS
        (out / "serve_soak.md").write_text(soak_section(json.loads((out / "soak.json").read_text())))
        return
    meta = run_metadata()
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    streams_result: dict[str, Any] | None = None
    with served("pagedllm-soak-", ["--disable-uvicorn-access-log", *args.serve_args]) as (url, server, log_path):
        text = log_path.read_text()
        m = BOUND_RE.search(text)
        if m is None:
            raise SystemExit("no 'Memory bound of the engine core' line in the start-up log")
        bound = {k: float(v) for k, v in zip(("total", "resident", "weights", "kv_cache", "swap", "workspace"),
                                             m.groups())}
        engine_pid = int(re.search(r"Engine core process (\d+) ready", text).group(1))  # type: ignore[union-attr]
        blocks = re.search(r"KV cache: (\d+) blocks of (\d+) tokens", text)
        if blocks is not None:
            bound["num_blocks"], bound["block_size"] = float(blocks.group(1)), float(blocks.group(2))
        print(m.group(0), flush=True)
        engine, api = psutil.Process(engine_pid), psutil.Process(server.pid)
        peak = PeakRSS(engine_pid)
        vocab = 49152
        print(f"{'round':>5} {'secs':>6} {'exact':>7} {'server GiB':>10} {'engine GiB':>10} {'engine peak':>11} "
              f"{'bound GiB':>9}", flush=True)
        for rnd in range(1, args.rounds + 1):
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.requests)]
            t0 = time.monotonic()
            results = asyncio.run(run_batch(url, prompts, args.max_tokens, args.concurrency))
            secs = time.monotonic() - t0
            exact, problems = check(results, args.max_tokens)
            engine_idle(url)
            row = {"round": rnd, "seconds": round(secs, 1), "exact": exact, "requests": args.requests,
                   "server_rss_gib": round(api.memory_info().rss / GIB, 3),
                   "engine_rss_gib": round(engine.memory_info().rss / GIB, 3),
                   "engine_peak_gib": round(peak.take() / GIB, 3), "problems": problems[:5]}
            rows.append(row)
            print(f"{rnd:>5} {secs:>6.1f} {exact:>4}/{args.requests:<3} {row['server_rss_gib']:>10.2f} "
                  f"{row['engine_rss_gib']:>10.2f} {row['engine_peak_gib']:>11.2f} {bound['total']:>9.2f}"
                  + (f"  {problems[:2]}" if problems else ""), flush=True)
        if args.streams:
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.stream_prompt_len)]
                       for _ in range(args.streams)]
            t0 = time.monotonic()
            results = asyncio.run(run_batch(url, prompts, args.stream_max_tokens, args.streams))
            secs = time.monotonic() - t0
            exact, problems = check(results, args.stream_max_tokens)
            after = engine_idle(url)
            streams_result = {
                "streams": args.streams, "max_tokens": args.stream_max_tokens, "exact": exact,
                "seconds": round(secs, 1), "engine_peak_gib": round(peak.take() / GIB, 3),
                "server_rss_gib": round(api.memory_info().rss / GIB, 3),
                "engine_rss_gib": round(engine.memory_info().rss / GIB, 3),
                "kv_cache_usage_after": after["pagedllm:kv_cache_usage_perc"],
                "running_after": after["pagedllm:num_requests_running"],
                "waiting_after": after["pagedllm:num_requests_waiting"], "problems": problems[:5],
            }
            print(f"{args.streams} concurrent streams: {exact}/{args.streams} exact ({args.stream_max_tokens} tokens, "
                  f"finish 'length') in {secs:.1f} s; engine peak {streams_result['engine_peak_gib']:.2f} GiB "
                  f"(bound {bound['total']:.2f}); afterwards KV usage {after['pagedllm:kv_cache_usage_perc']}, "
                  f"running {after['pagedllm:num_requests_running']:.0f}, waiting "
                  f"{after['pagedllm:num_requests_waiting']:.0f}" + (f"; {problems[:3]}" if problems else ""),
                  flush=True)
        peak.stop()
        alive = server.poll() is None and engine.is_running()
    under = all(r["engine_peak_gib"] <= bound["total"] for r in rows) and (
        streams_result is None or streams_result["engine_peak_gib"] <= bound["total"])
    print(f"engine RSS {'stayed under' if under else 'WENT OVER'} the stated bound; server alive to the end: {alive}; "
          f"exit code {server.returncode}")
    if args.no_write:
        return
    meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    locked = psutil.Process().parent().name() == "flock"
    meta["command"] = ("flock /tmp/pagedllm-bench.lock " if locked else "nice -n 10 ") + command_line()
    result = {"meta": meta, "bound_gib": bound, "rounds": rows, "streams": streams_result, "under_bound": under,
              "alive": alive, "args": {k: v for k, v in vars(args).items() if k != "serve_args"},
              "serve_args": args.serve_args}
    out = RESULTS
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "serve_soak.md").write_text(soak_section(result))
    print(f"wrote {out / 'soak.json'} and {out / 'serve_soak.md'}")


def soak_section(r: dict[str, Any]) -> str:
    b, a, s = r["bound_gib"], r["args"], r["streams"]
    meta = r["meta"]
    lines = [
        "## Soak: memory bounded as stated, exact completions under load",
        "",
        f"```\n{meta['command']}\n```",
        "",
        f"`pagedllm serve` with {'the default model and flags' if not r['serve_args'] else ' '.join(r['serve_args'])}; "
        f"machine {meta.get('cpu_model', '?')}, {meta.get('cpu_cores', '?')} cores, {meta.get('memory_gib', '?')} GiB, "
        f"load average at start {meta.get('load_avg_at_start')}; commit {meta.get('commit', '?')}, run {meta.get('time', '?')}.",
        "",
        f"The start-up log states the engine core's bound: **{b['total']:.2f} GiB** = {b['resident']:.2f} GiB once "
        f"loaded (weights {b['weights']:.2f} GiB + runtime) + {b['kv_cache']:.2f} GiB KV cache + {b['swap']:.2f} GiB "
        f"host swap + {b['workspace']:.2f} GiB step workspace. The KV pool is committed page by page as blocks are "
        "first used, so the engine's RSS climbs until every block has held a request (freed blocks keep their "
        "prefix-cache content, and never-used blocks are handed out first), then stays flat: the climb is the cache "
        "filling, not a leak, and the column 'engine RSS less their KV' (RSS minus the KV pages of the blocks used "
        "so far) shows what else the engine holds.",
        "",
        f"Rounds of {a['requests']} streamed completions ({a['prompt_len']} distinct random prompt tokens, "
        f"{a['max_tokens']} output tokens, ignore_eos, {a['concurrency']} at a time):",
        "",
        "| round | seconds | exact completions | API server RSS (GiB) | engine RSS (GiB) | engine peak (GiB) "
        "| KV blocks used so far | engine RSS less their KV (GiB) | bound (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    # Distinct random prompts share no prefix: every request takes fresh blocks while never-used
    # ones remain, so the blocks used so far are rounds x requests x blocks per request.
    num_blocks, bs = b.get("num_blocks"), b.get("block_size")
    per_req = -(-(a["prompt_len"] + a["max_tokens"]) // int(bs)) if bs else 0
    for row in r["rounds"]:
        used = min(row["round"] * row["requests"] * per_req, int(num_blocks)) if num_blocks else None
        less = (row["engine_rss_gib"] - used / num_blocks * b["kv_cache"]) if used is not None else None
        lines.append(f"| {row['round']} | {row['seconds']:.0f} | {row['exact']}/{row['requests']} | "
                     f"{row['server_rss_gib']:.2f} | {row['engine_rss_gib']:.2f} | {row['engine_peak_gib']:.2f} | "
                     f"{used if used is not None else '-'} of {int(num_blocks or 0)} | "
                     f"{'-' if less is None else format(less, '.2f')} | {b['total']:.2f} |")
    if s is not None:
        lines += ["", f"Then **{s['streams']} streams at once** ({s['max_tokens']} tokens each, ignore_eos): "
                  f"{s['exact']}/{s['streams']} completed with exactly {s['max_tokens']} tokens and finish_reason "
                  f"\"length\" in {s['seconds']:.0f} s; engine peak RSS {s['engine_peak_gib']:.2f} GiB "
                  f"(bound {b['total']:.2f}), API server {s['server_rss_gib']:.2f} GiB; afterwards KV cache usage "
                  f"{s['kv_cache_usage_after']:g} (every block free), {s['running_after']:.0f} running, "
                  f"{s['waiting_after']:.0f} waiting."]
    lines += ["", f"Engine RSS {'stayed under' if r['under_bound'] else 'went over'} the stated bound throughout; "
              f"the server was {'alive' if r['alive'] else 'NOT alive'} at the end."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
