"""Run metadata and the timing helper that the benchmarks share."""

from __future__ import annotations

import sys

import pytest

from pagedllm.benchmarks import env


@pytest.mark.parametrize("argv,command", [
    (["/x/.venv/bin/pagedllm", "bench", "latency", "--dtype", "a b"], "pagedllm bench latency --dtype 'a b'"),
    (["/x/pagedllm/__main__.py", "bench", "serve"], "pagedllm bench serve"),
    (["/x/pagedllm/benchmarks/kernels/native_decode.py", "--rows", "1,2"], "/x/pagedllm/benchmarks/kernels/native_decode.py --rows 1,2"),
])
def test_command_line_names_the_cli_or_the_script(monkeypatch, argv, command):
    monkeypatch.setattr(sys, "argv", argv)
    assert env.run_metadata()["command"] == command


def test_call_times_warms_up_once_then_times_each_call():
    calls = []
    times = env.call_times(lambda: calls.append(1), 5)
    assert len(calls) == 6 and len(times) == 5 and all(t >= 0 for t in times)
