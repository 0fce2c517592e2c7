"""Runs tests/triton_interp (the Triton kernels against the torch reference) under Triton's
interpreter, in a subprocess so that TRITON_INTERPRET=1 is set before triton is imported and
cannot leak into any other test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton_interp
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("selection", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_triton_kernels_under_the_interpreter(selection: str, tiny_model_dir: str) -> None:
    """The tests there marked slow (whole engines under the interpreter) run with make test-slow.
    They use this session's tiny model folder (tests/conftest.py's TINY_MODEL_DIR_ENV)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PAGEDLLM_TEST_TINY_MODEL_DIR": tiny_model_dir}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", selection,
         str(ROOT / "tests" / "triton_interp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
