"""The kernel cache: processes that start together on a cold cache compile each source once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CC = shutil.which("gcc") or shutil.which("cc")


@pytest.mark.skipif(CC is None, reason="no C compiler (gcc/cc) on PATH")
def test_processes_on_a_cold_cache_compile_a_source_once(tmp_path: Path) -> None:
    src = tmp_path / "answer.c"
    src.write_text("int answer(void) { return 42; }\n")
    calls = tmp_path / "calls.log"
    wrapper = tmp_path / "cc.sh"  # the compiler, counting its calls (and slow enough for the others to arrive)
    wrapper.write_text(f'#!/bin/sh\necho x >> "{calls}"\nsleep 1\nexec "{CC}" "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CC": str(wrapper), "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys\nfrom pathlib import Path\nfrom pagedllm.native.build import compile_native\n"
            f"lib = compile_native(Path({str(src)!r}))\nsys.exit(0 if lib is not None and lib.answer() == 42 else 1)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    assert calls.read_text().count("x") == 1
    assert len(list((tmp_path / "cache" / "kernels").glob("answer_*.so"))) == 1
