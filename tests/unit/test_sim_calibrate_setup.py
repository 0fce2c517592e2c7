"""`pagedllm simulate calibrate --dtype/--threads`: bad values are refused, a real run on two threads in
bfloat16 times its steps, and the simulated model follows the dtype."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.simulator.calibrate import Setup, run_real
from pagedllm.simulator.model import model_from_checkpoint
from pagedllm.simulator.trace import synthetic_trace


def test_setup_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="'int8'"):
        Setup("int8")
    with pytest.raises(ValueError, match="at least 1, not 0"):
        Setup("float32", 0)


def test_calibrate_cli_refuses_zero_threads(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli import main

    assert main(["simulate", "calibrate", "--threads", "0", "--output", "/nonexistent/p.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "threads must be at least 1, not 0" in err[0]


def test_bf16_two_thread_run_times_steps_in_its_dtype(tiny_model_dir: str) -> None:
    before = torch.get_num_threads()
    try:
        trace = synthetic_trace(3, math.inf, "16:40", "2:5", seed=3)
        run = run_real(tiny_model_dir, {"block_size": 16, "num_kv_blocks": 64}, trace,
                       setup=Setup("bfloat16", 2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert run.steps and all(dt > 0 for _, dt in run.steps)
    assert all(r.finish_s >= r.first_token_s > 0 for r in run.requests)
    # The simulated model's bytes per element follow the dtype.
    assert model_from_checkpoint(tiny_model_dir, "bfloat16").dtype_bytes == 2
    assert model_from_checkpoint(tiny_model_dir, "float32").dtype_bytes == 4
