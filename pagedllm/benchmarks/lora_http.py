"""`pagedllm bench lora`'s run-time load phase: a real `pagedllm serve` with --enable-lora and
PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1, greedy streams of an adapter running, while adapters are
loaded one after another with POST /v1/load_lora_adapter (each one's wall time, client side), and
then asked for once each (the first request's latency includes the worker's read of the folder
and the slot fill). Every stream must end with finish_reason "length": a load that dropped a
request in flight fails the phase."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any


def measure_http_load(model: str | None, dtype: str, kv_cache_memory: str, paths: list[str], rank: int,
                      streams: int = 4, max_tokens: int = 64) -> dict[str, Any]:
    """Load times (ms) of `paths[1:]` at run time while `streams` streams of adapter paths[0] run."""
    import httpx

    from pagedllm.benchmarks.server_probe import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *(["--model", model] if model else []), "--port", str(port),
           "--dtype", dtype, "--kv-cache-memory", kv_cache_memory, "--enable-lora", "--max-loras", "2",
           "--max-lora-rank", str(rank), "--max-cpu-loras", "2", "--lora-modules", f"first={paths[0]}"]
    env = {**os.environ, "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        why = wait_healthy(url, proc, timeout=300)
        if why is not None:
            raise RuntimeError(f"the server {why}")
        http = httpx.Client(base_url=url, timeout=120)
        finishes: list[str] = []
        errors: list[str] = []

        def stream() -> None:
            try:
                r = http.post("/v1/completions", json={"model": "first", "prompt": "Once upon a time",
                                                       "max_tokens": max_tokens, "temperature": 0,
                                                       "ignore_eos": True})
                r.raise_for_status()
                finishes.append(r.json()["choices"][0]["finish_reason"])
            except Exception as e:  # noqa: BLE001 - reported as a dropped request
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=stream) for _ in range(streams)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the streams are running
        load_ms = []
        for i, path in enumerate(paths[1:]):
            t0 = time.perf_counter()
            r = http.post("/v1/load_lora_adapter", json={"lora_name": f"extra{i}", "lora_path": path})
            load_ms.append((time.perf_counter() - t0) * 1e3)
            if r.status_code != 200:
                raise RuntimeError(f"loading {path} answered {r.status_code}: {r.text}")
        for t in threads:
            t.join()
        first_ms = []
        for i in range(len(paths) - 1):  # the first request with each: the worker reads it, fills a slot
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={"model": f"extra{i}", "prompt": "Hi", "max_tokens": 1})
            r.raise_for_status()
            first_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        http.post("/v1/completions", json={"model": "extra0", "prompt": "Hi", "max_tokens": 1}).raise_for_status()
        again_ms = (time.perf_counter() - t0) * 1e3
        return {"load_ms": load_ms, "load_ms_median": statistics.median(load_ms), "load_ms_max": max(load_ms),
                "first_request_ms": first_ms, "warm_request_ms": again_ms, "streams": streams,
                "streams_completed": finishes.count("length"), "stream_errors": errors}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
