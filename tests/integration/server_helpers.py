"""A real `pagedllm serve` subprocess for tests, on 127.0.0.1, and helpers to read it.

How a test module gets a server (at most one per module; a server start is the costliest thing in
the suite, seconds for the default model):

* The default model with `DEFAULT_SERVER_FLAGS`: ask for the session fixture `default_server`
  (tests/integration/conftest.py). Every module that does shares one process, started on first
  use; its requests carry `API_KEY`. Tests on it must not depend on what other modules did before
  them (counters only grow; wait for idleness with `wait_idle` before counting blocks)::

      @pytest.fixture(scope="module")
      def server(default_server: Server) -> Server:
          return default_server

* all-MiniLM-L6-v2 in float32 (`MINILM_SERVER_ARGS`): the session fixture `minilm_server`, shared
  in the same way by the pooling modules.

* The tiny random model of `tiny_model_dir` with `TINY_SERVER_FLAGS`: the session fixture
  `tiny_server` (it must exit 0 without a traceback in its log).

* Other flags or another model: a module fixture around `serve`::

      @pytest.fixture(scope="module")
      def server(tmp_path_factory: pytest.TempPathFactory):
          with serve(tmp_path_factory.mktemp("tools"), "--tool-call-parser", "hermes") as s:
              yield s

Given a module's `server` fixture, tests/integration/conftest.py's module fixtures `http` (httpx),
`client` (openai) and `model` (the served id) follow it; a module that needs other clients defines
its own fixture of that name. `server.http()` and `server.openai()` give clients on its address
that send its API key.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from pagedllm.benchmarks.server_probe import free_port, parse_metrics, wait_healthy
from pagedllm.benchmarks.server_probe import wait_idle as engine_idle


# The API key of the shared default-model server, and its flags (the union of what the modules on it
# need: float32 so that greedy replies equal transformers' and LLM's, a KV pool that holds the
# model's whole context, a bounded queue, a small Responses store).
API_KEY = "sk-pagedllm-test"
RESPONSES_STORE_SIZE = 3
DEFAULT_SERVER_FLAGS = ("--kv-cache-memory", "512MiB", "--dtype", "float32", "--api-key", API_KEY,
                        "--max-queued-requests", "1000", "--responses-store-size", str(RESPONSES_STORE_SIZE))
# The shared embedding server's model and flags (no API key).
MINILM_SERVER_ARGS = ("all-minilm-l6-v2", "--dtype", "float32", "--kv-cache-memory", "64MiB")
# The shared tiny-model server's flags (after the tiny model's folder) and API key: float32 for the
# embedding oracle, a small pool and batch, and short header-read and keep-alive timeouts that the
# bad-input tests time.
TINY_API_KEY = "sk-pagedllm-tiny"
TINY_SERVER_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "128", "--max-num-seqs", "16", "--api-key", TINY_API_KEY,
                     "--header-read-timeout", "1", "--timeout-keep-alive", "3")


class Server:
    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None,
                 entry: list[str] | None = None) -> None:
        """`entry`: what runs the CLI after the interpreter (default `-m pagedllm.entrypoints.cli`;
        the fault tests' launcher script, with its options)."""
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
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

    def http(self, timeout: float = 120.0) -> httpx.Client:
        """An httpx client on the server's address, sending its API key (if it has one)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def openai(self, timeout: float = 300.0):
        """The official openai client on the server's /v1, with its API key, no retries."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=timeout)

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


@contextlib.contextmanager
def serve(log_dir: Path, *args: str, env: dict[str, str] | None = None, entry: list[str] | None = None,
          timeout: float = 180.0) -> Iterator[Server]:
    """A started server (`args`: `pagedllm serve`'s model and flags; its log is log_dir/server.log)
    that is healthy on entry and stopped on exit."""
    s = Server(log_dir / "server.log", *args, env=env, entry=entry)
    try:
        s.wait_ready(timeout)
        yield s
    finally:
        s.stop()


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
