"""A server process seen from outside: a free loopback port for it, waiting for its /health,
reading its /metrics, waiting until its engine is idle; `pagedllm serve` launched with its output
in a log file (`bench soak`, `bench ui-cost`). `bench serve`, `bench soak` and the server tests
(tests/integration/server_helpers.py) share these."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pagedllm.benchmarks.script import ROOT

_SAMPLE = re.compile(r"^(pagedllm:\w+)(?:\{[^}]*\})? (\S+)$", re.M)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled view of a /metrics page: name{...} value -> {name: value} (last sample of each name)."""
    return {m[0]: float(m[1]) for m in _SAMPLE.findall(text)}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, interval: float = 0.5,
                 tick: Callable[[], None] | None = None) -> str | None:
    """Polls `url`/health until it answers 200 (None) or says why it never will: the process
    exited, or `timeout` seconds passed. `tick` is called after each wait."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode} before it was healthy"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return f"was not healthy after {timeout:.0f} s"
        time.sleep(interval)
        if tick is not None:
            tick()


def wait_idle(read_metrics: Callable[[], dict[str, float]], timeout: float, interval: float = 0.1) -> dict[str, float]:
    """Waits until nothing runs or waits and no KV block is in use; returns the last metrics.
    TimeoutError after `timeout` seconds, naming what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics()
        busy = (m["pagedllm:num_requests_running"], m["pagedllm:num_requests_waiting"],
                m["pagedllm:kv_cache_usage_perc"])
        if busy == (0, 0, 0):
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine still holds requests or KV blocks after {timeout} s "
                               f"(running, waiting, KV usage): {busy}")
        time.sleep(interval)


@contextmanager
def served(log_prefix: str, serve_flags: list[str], timeout: float = 600) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`pagedllm serve SERVE_FLAGS` on a free loopback port, its output in a temporary log file
    (`log_prefix`...log): yields (base URL, process, log path) once /health answers; SystemExit with
    the log's tail where it never does. On the way out the server gets SIGTERM (killed after 30 s)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *serve_flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    print("launching:", " ".join(cmd[3:]), f"(log {log_path})", flush=True)
    log = open(log_path, "wb")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        why = wait_healthy(url, server, timeout)
        if why is not None:
            raise SystemExit(f"the server {why}:\n{log_path.read_text()[-3000:]}")
        yield url, server, log_path
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()
