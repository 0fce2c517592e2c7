"""A real `pagedllm serve` subprocess for tests, on 127.0.0.1, and helpers to read it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pagedllm.benchmarks.server_probe import free_port, parse_metrics, wait_healthy
from pagedllm.benchmarks.server_probe import wait_idle as engine_idle


class Server:
    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None,
                 entry: list[str] | None = None) -> None:
        """`entry`: what runs the CLI after the interpreter (default `-m pagedllm.entrypoints.cli`;
        the fault tests' launcher script, with its options)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        entry = entry or ["-m", "pagedllm.entrypoints.cli"]
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port),
               "--disable-uvicorn-access-log", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("PAGEDLLM_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        why = wait_healthy(self.url, self.proc, timeout, interval=0.2)
        if why is not None:
            pytest.fail(f"server {why}:\n{self.output()[-3000:]}")

    def engine_pid(self) -> int:
        """The engine-core process (the server logs its pid when it is ready)."""
        m = re.search(r"Engine core process (\d+) ready", self.output())
        assert m, self.output()[-2000:]
        return int(m.group(1))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def metrics(http: httpx.Client) -> dict[str, float]:
    """Unlabelled view of /metrics: name{...} value -> {name: value} (last sample of each name)."""
    return parse_metrics(http.get("/metrics").text)


def assert_error_shape(body: dict) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict[str, float]:
    """Waits until nothing runs or waits and no KV block is in use; returns the metrics."""
    return engine_idle(lambda: metrics(http), timeout, interval=0.05)
