"""`import pagedllm` bounds how long an OpenMP thread spins at a barrier (GOMP_SPINCOUNT, read by
libgomp when torch loads it) unless the user chose a value: see pagedllm/__init__.py."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = "import os, pagedllm, torch; print(os.environ['GOMP_SPINCOUNT'])"


def _spincount(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if env_value is not None:
        env["GOMP_SPINCOUNT"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_sets_a_bounded_spin_before_torch_loads() -> None:
    assert _spincount(None) == "10000"


def test_a_value_the_user_set_wins() -> None:
    assert _spincount("250") == "250"
