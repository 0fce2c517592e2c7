"""`pagedllm bench serve`: an open-loop client for any OpenAI-compatible server.

Requests are streamed /v1/completions calls with token-id prompts, greedy, `ignore_eos` and
`max_tokens` = the workload's output length, sent at Poisson arrivals of `--request-rate` per second
(inf: all at once) under an optional `--max-concurrency` cap. `--launch pagedllm|vllm` starts the
server on a free loopback port, waits for /health, runs, and stops it. `--offline-baseline` then runs
the offline engine (`LLM.generate` in a fresh process, with the engine flags of `--server-args`) on
the same workload and reports the server's output tok/s over the offline engine's, rate by rate.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
from tqdm.auto import tqdm

from pagedllm.benchmarks.env import PeakRSSMonitor, run_metadata
from pagedllm.benchmarks.serve_metrics import RequestResult, compute_metrics
from pagedllm.benchmarks.server_probe import free_port, wait_healthy
from pagedllm.benchmarks.workloads import BenchRequest, workload_summary

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs


# ---- one request ----------------------------------------------------------------------------

def sampling_fields(sampling: dict[str, Any] | None) -> dict[str, Any]:
    """The request body's sampling fields: greedy by default; top_p and top_k only where they cut."""
    sp = sampling or {"temperature": 0.0}
    fields: dict[str, Any] = {"temperature": sp.get("temperature", 0.0)}
    if sp.get("top_p", 1.0) < 1.0:
        fields["top_p"] = sp["top_p"]
    if sp.get("top_k", 0) > 0:
        fields["top_k"] = sp["top_k"]
    return fields


async def send_request(client: aiohttp.ClientSession, url: str, model: str | None, req: BenchRequest,
                       headers: dict[str, str], sampling: dict[str, Any] | None = None) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        **sampling_fields(sampling),
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    chunks = 0
    usage_tokens = None
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status}: {text[:200]}"
                return result
            async for raw in resp.content:  # one line at a time, split by aiohttp's C parser
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    result.error = f"stream error: {str(msg['error'])[:200]}"
                    return result
                if msg.get("usage") and msg["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(msg["usage"]["completion_tokens"])
                if not msg.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.latency = last - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "the stream carried no tokens"
    return result


def parse_request_rates(text: str, flag: str = "--request-rate") -> list[float]:
    """'inf,1' -> [inf, 1.0]: request rates per second (inf: all at once), every one positive."""
    try:
        rates = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"{flag} takes positive numbers or inf, got {text!r}")
    return rates


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start): Poisson process of `rate`/s, or all at 0 for rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(base_url: str, model: str | None, reqs: list[BenchRequest], rate: float,
                   max_concurrency: int | None, seed: int, api_key: str | None,
                   request_timeout: float, desc: str,
                   sampling: dict[str, Any] | None = None) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(reqs), desc=desc, dynamic_ncols=True)
    # aiohttp (as vLLM's serving benchmark uses) parses the streams in C: the client takes less of
    # the CPU the server under test runs on. `request_timeout` bounds each read, as a stall guard.
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(reqs))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, url, model, req, headers, sampling)
            else:
                async with sem:
                    r = await send_request(client, url, model, req, headers, sampling)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for req, at in zip(reqs, arrival_offsets(len(reqs), rate, seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def discover_model(base_url: str, api_key: str | None) -> str | None:
    """The first model id the server lists at /v1/models (None if it lists none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return None


# ---- launching a server ---------------------------------------------------------------------

class LaunchError(Exception):
    """The server could not be started; the message says why."""


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of group pgid has exited within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of the group that is no longer ours to signal
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


class LaunchedServer:
    """Starts a server process on a free loopback port and stops it (its whole process group)."""

    def __init__(self, kind: str, model: str | None, extra_args: list[str], peers_venv: str | None,
                 startup_timeout: float, env: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.env = dict(os.environ if env is None else env)
        if kind == "pagedllm":
            self.cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
                        "--port", str(self.port), "--disable-uvicorn-access-log"]
            if model:
                self.cmd += ["--model", model]
        elif kind == "vllm":
            from pagedllm.benchmarks.throughput import BackendUnavailable, hf_model_dir, peers_python

            try:
                python = peers_python(peers_venv)
                folder = hf_model_dir(model)
            except BackendUnavailable as exc:
                raise LaunchError(str(exc)) from None
            # vLLM on its default dtype (bfloat16 on CPUs that have it), as a user would run it.
            self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                        "--host", "127.0.0.1", "--port", str(self.port)]
            self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            self.env.pop("PYTHONPATH", None)
        else:
            raise LaunchError(f"--launch must be pagedllm or vllm, got {kind!r}")
        self.cmd += extra_args
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"pagedllm-bench-{kind}-server-", suffix=".log")[1])
        self.startup_s: float | None = None
        self.monitor: PeakRSSMonitor | None = None

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def __enter__(self) -> LaunchedServer:
        print(f"starting {self.kind} server: {shlex.join(self.cmd)} (log: {self.log_path})", file=sys.stderr)
        t0 = time.perf_counter()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=tempfile.gettempdir())
        log.close()
        self.monitor = PeakRSSMonitor(self.proc.pid, interval=0.5).__enter__()
        bar = tqdm(desc=f"waiting for {self.kind} /health", unit="s", dynamic_ncols=True)
        try:
            why = wait_healthy(self.base_url, self.proc, self.startup_timeout, interval=1.0, tick=lambda: bar.update(1))
            if why is not None:
                raise LaunchError(f"the {self.kind} server {why}; last lines of {self.log_path}:\n{self.log_tail()}")
        except BaseException:
            bar.close()
            self.stop()
            raise
        bar.close()
        self.startup_s = time.perf_counter() - t0
        print(f"{self.kind} server healthy after {self.startup_s:.1f} s at {self.base_url}", file=sys.stderr)
        return self

    def stop(self) -> None:
        """Stops the server's whole process group and returns once every process of it is gone, so
        that a server still shutting down (vLLM's engine core outlives its API process) does not
        share the cores with the next one's start-up and runs."""
        if self.monitor is not None:
            self.monitor.__exit__(None, None, None)
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if not _group_gone(pgid, timeout=30):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            _group_gone(pgid, timeout=10)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is None:  # keep the server's log only when something went wrong
            self.log_path.unlink(missing_ok=True)

    @property
    def peak_rss(self) -> int:
        return self.monitor.peak if self.monitor else 0


# ---- the benchmark --------------------------------------------------------------------------

def rate_variant(reqs: list[BenchRequest], index: int) -> list[BenchRequest]:
    """The workload for the index-th request rate: the same lengths, with each prompt's first token
    moved by `index` (within the ids the workload already uses), so that no prompt shares a cached
    prefix block with the runs at earlier rates on the same server (either engine's prefix cache
    would otherwise serve the later rates' prompts from memory)."""
    if index == 0:
        return reqs
    span = max(max(r.prompt_token_ids, default=0) for r in reqs) + 1
    return [BenchRequest([(r.prompt_token_ids[0] + index) % span, *r.prompt_token_ids[1:]] if r.prompt_token_ids
                         else r.prompt_token_ids, r.output_len) for r in reqs]


def run_serve_bench(base_url: str, reqs: list[BenchRequest], workload_info: dict[str, Any],
                    opts: dict[str, Any], server: LaunchedServer | None = None) -> dict[str, Any]:
    """One run per request rate on the same workload; returns the JSON-able report."""
    meta = run_metadata()
    model = opts.get("model_name") or discover_model(base_url, opts.get("api_key"))
    if opts.get("num_warmup"):
        warm = [BenchRequest(reqs[0].prompt_token_ids[:16], 4)] * opts["num_warmup"]
        asyncio.run(run_load(base_url, model, warm, float("inf"), None, 0, opts.get("api_key"),
                             opts["request_timeout"], "warm-up"))
    runs = []
    for i, rate in enumerate(opts["request_rates"]):
        results, duration = asyncio.run(run_load(
            base_url, model, rate_variant(reqs, i), rate, opts.get("max_concurrency"), opts["seed"], opts.get("api_key"),
            opts["request_timeout"], f"rate {rate:g}/s", opts.get("sampling")))
        m = compute_metrics(results, duration, opts.get("slo_ttft_ms"), opts.get("slo_tpot_ms"))
        m["request_rate"] = rate if rate != float("inf") else "inf"
        m["max_concurrency"] = opts.get("max_concurrency")
        runs.append(m)
    meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report: dict[str, Any] = {
        "benchmark": "serve",
        "meta": meta,
        "base_url": base_url,
        "served_model": model,
        "server": opts.get("server_label") or (server.kind if server else "external"),
        "workload": workload_info | workload_summary(reqs),
        "sampling": sampling_fields(opts.get("sampling")),
        "runs": runs,
    }
    if server is not None:
        report["server_startup_s"] = server.startup_s
        report["server_command"] = shlex.join(server.cmd)
        report["server_peak_rss_bytes"] = server.peak_rss
    return report


def format_serve_table(report: dict[str, Any]) -> str:
    head = (f"{'rate/s':>7} {'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} "
            f"{'TTFT ms mean/med/p90/p99':>28} {'TPOT ms mean/med/p90/p99':>28} {'ITL ms med/p99':>16} "
            f"{'E2E s med/p99':>14} {'goodput':>8}")
    sampling = ", ".join(f"{k} {v:g}" for k, v in report.get("sampling", {}).items()) or "temperature 0"
    lines = [f"server: {report['server']} at {report['base_url']} (model {report['served_model']}; "
             f"requests at {sampling})", head]

    def q(d: dict[str, float | None], keys=("mean", "median", "p90", "p99"), scale: float = 1.0) -> str:
        return "/".join("-" if d[k] is None else f"{d[k] * scale:.0f}" if scale == 1.0 else f"{d[k] * scale:.1f}"
                        for k in keys)

    for m in report["runs"]:
        good = f"{m['goodput']:.2f}" if "goodput" in m else "-"
        lines.append(
            f"{str(m['request_rate']):>7} {str(m['max_concurrency'] or '-'):>5} {m['completed']:>5} {m['failed']:>4} "
            f"{m['request_throughput']:>7.3f} {m['output_throughput']:>9.1f} {q(m['ttft_ms']):>28} "
            f"{q(m['tpot_ms']):>28} {q(m['itl_ms'], ('median', 'p99')):>16} "
            f"{q(m['e2el_ms'], ('median', 'p99'), 0.001):>14} {good:>8}"
        )
        for e in m["errors"]:
            lines.append(f"        error: {e}")
    return "\n".join(lines)


# The figures serve_ratios compares, in its order.
RATIO_KEYS = ("output_throughput", "mean_ttft", "mean_tpot", "median_itl", "goodput", "peak_rss")


def serve_ratios(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first server's figures over the second's, rate by rate (e.g. output tok/s 1.5 = 50% more)."""
    if len(reports) != 2 or any("error" in r for r in reports):
        return []
    ours, peer = reports
    out = []
    for a, b in zip(ours["runs"], peer["runs"]):
        def ratio(x: float | None, y: float | None) -> float | None:
            return None if x is None or not y else round(x / y, 3)

        out.append({
            "request_rate": a["request_rate"],
            "servers": f"{ours['server']}/{peer['server']}",
            "output_throughput": ratio(a["output_throughput"], b["output_throughput"]),
            "mean_ttft": ratio(a["ttft_ms"]["mean"], b["ttft_ms"]["mean"]),
            "mean_tpot": ratio(a["tpot_ms"]["mean"], b["tpot_ms"]["mean"]),
            "median_itl": ratio(a["itl_ms"]["median"], b["itl_ms"]["median"]),
            "goodput": ratio(a.get("goodput"), b.get("goodput")),
            "peak_rss": ratio(ours.get("server_peak_rss_bytes"), peer.get("server_peak_rss_bytes")),
        })
    return out


# ---- the offline engine on the same workload ------------------------------------------------

def server_engine_args(model: str | None, server_args: list[str]) -> EngineArgs:
    """The engine flags a `pagedllm serve` command line carries (server flags are left out)."""
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    EngineArgs.add_cli_args(parser)  # no positional MODEL: the launched server gets --model
    try:
        ns, _server_flags = parser.parse_known_args(server_args)
    except argparse.ArgumentError as exc:
        raise ValueError(f"--server-args {shlex.join(server_args)!r}: {exc}") from None
    args = EngineArgs.from_cli_args(ns)
    if model is not None and args.model is None:
        args.model = model
    return args


def run_offline_baseline(reqs: list[BenchRequest], model: str | None, server_args: list[str],
                         timeout: float | None = None, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """`LLM.generate` on exactly `reqs` (the requests' sampling settings, greedy by default,
    ignore_eos, the same output lengths, detokenized as the server does) in a fresh process with the
    server's engine flags; the child's timing covers the generate call alone. Raises
    BackendUnavailable if it fails."""
    from pagedllm.benchmarks.throughput import child_engine_args, run_backend
    from pagedllm.benchmarks.workloads import dump_workload

    ea = server_engine_args(model, server_args)
    engine_kwargs = child_engine_args(ea)
    opts = {"model": ea.model, "engine_args": engine_kwargs, "seed": ea.seed, "timeout": timeout, "sampling": sampling}
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-offline-") as workdir:
        wl_path = str(Path(workdir) / "workload.json")
        dump_workload(reqs, wl_path)
        row = run_backend("pagedllm", opts, wl_path, workdir, ea.dtype)
    keep = ("dtype", "elapsed_s", "num_requests", "prompt_tokens", "output_tokens", "output_tokens_per_s",
            "requests_per_s", "peak_rss_bytes", "startup_s")
    return {k: row[k] for k in keep if k in row} | {"engine_flags": shlex.join(server_args)}


def offline_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The server's output tok/s over the offline engine's, per request rate (1.0 = as fast)."""
    offline = report.get("offline") or {}
    base = offline.get("output_tokens_per_s")
    if not base:
        return []
    return [{"request_rate": m["request_rate"], "output_throughput": round(m["output_throughput"] / base, 3),
             "exact_tokens": m["output_tokens"] == offline.get("output_tokens")} for m in report["runs"]]


def format_offline(report: dict[str, Any]) -> str:
    off = report["offline"]
    lines = [f"offline engine on the same workload (LLM.generate, {off['dtype']}, flags: "
             f"{off['engine_flags'] or 'defaults'}): {off['output_tokens_per_s']:.1f} output tok/s, "
             f"{off['output_tokens']} tokens in {off['elapsed_s']:.1f} s",
             f"{'rate/s':>7} {'server/offline output tok/s':>28}"]
    for r in report["offline_ratio"]:
        lines.append(f"{str(r['request_rate']):>7} {r['output_throughput']:>28.3f}"
                     + ("" if r["exact_tokens"] else "  (token counts differ)"))
    return "\n".join(lines)


def repeat_summary(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Rate by rate over repeated rounds (`--repeat`): each round's server/offline output ratio and
    first-server-over-second ratios, with their medians. One run of each on a host whose speed drifts
    says little; rounds that alternate the order and a median say more."""
    import statistics

    def med(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 3) if xs else None

    offline: dict[Any, list[float | None]] = {}
    for reports in rounds:
        for r in reports:
            for x in r.get("offline_ratio") or []:
                offline.setdefault(x["request_rate"], []).append(x["output_throughput"])
    pair: dict[Any, dict[str, Any]] = {}
    for reports in rounds:
        for x in serve_ratios(reports):
            row = pair.setdefault(x["request_rate"], {"servers": x["servers"], **{k: [] for k in RATIO_KEYS}})
            for k in RATIO_KEYS:
                row[k].append(x[k])
    return {
        "rounds": len(rounds),
        "offline_ratio": [{"request_rate": rate, "per_round": xs, "median": med(xs)} for rate, xs in offline.items()],
        "ratios": [{"request_rate": rate, "servers": row["servers"],
                    **{k: {"per_round": row[k], "median": med(row[k])} for k in RATIO_KEYS}}
                   for rate, row in pair.items()],
    }


def format_repeat_summary(summary: dict[str, Any]) -> str:
    lines = [f"over {summary['rounds']} rounds (per round, then the median)"]
    if summary["offline_ratio"]:
        lines.append(f"{'rate/s':>7}  server/offline output tok/s")
        for x in summary["offline_ratio"]:
            lines.append(f"{str(x['request_rate']):>7}  " + " ".join(f"{v:.3f}" for v in x["per_round"])
                         + f"  median {x['median']:.3f}")
    if summary["ratios"]:
        lines.append(f"{'rate/s':>7}  {summary['ratios'][0]['servers']}: output tok/s | mean TTFT | mean TPOT")
        for x in summary["ratios"]:
            cells = []
            for k in ("output_throughput", "mean_ttft", "mean_tpot"):
                per = " ".join("-" if v is None else f"{v:.2f}" for v in x[k]["per_round"])
                cells.append(f"{per} (median {'-' if x[k]['median'] is None else format(x[k]['median'], '.2f')})")
            lines.append(f"{str(x['request_rate']):>7}  " + " | ".join(cells))
    return "\n".join(lines)


def format_serve_ratios(ratios: list[dict[str, Any]]) -> str:
    lines = [f"ratios {ratios[0]['servers']} (throughput and goodput: higher is better; latency, RSS: lower)",
             f"{'rate/s':>7} " + " ".join(f"{k:>17}" for k in RATIO_KEYS)]
    for r in ratios:
        lines.append(f"{str(r['request_rate']):>7} " + " ".join(
            f"{'-' if r[k] is None else format(r[k], '.2f'):>17}" for k in RATIO_KEYS))
    return "\n".join(lines)
