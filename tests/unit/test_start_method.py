"""How the engine starts its processes (pagedllm/executor/start_method.py): forking is judged
unsafe once threads that a fork leaves behind run (torch's OpenMP pool, another Python thread)
and safe with OpenBLAS's pool or tqdm's monitor; a main script's unguarded top level is found where spawn
would run it again. Each check runs in a fresh interpreter, whose threads this test controls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HAZARDS = textwrap.dedent("""
    import json, threading, time
    import numpy, torch
    from pagedllm.executor.start_method import fork_hazard, process_context
    out = {"fresh": fork_hazard(), "fresh_method": process_context("test").get_start_method()}
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="sleeper")
    t.start()
    out["python_thread"] = fork_hazard()
    stop.set()
    t.join()
    out["thread_joined"] = fork_hazard()
    from tqdm.auto import tqdm
    for _ in tqdm(range(3), mininterval=0):  # leaves tqdm's monitor thread running
        pass
    out["tqdm_monitor"] = [[t.name for t in threading.enumerate()], fork_hazard()]
    numpy.ones((400, 400)) @ numpy.ones((400, 400))  # OpenBLAS's pool: stops for a fork
    out["openblas"] = fork_hazard()
    torch.set_num_threads(2)
    torch.randn(512, 512) @ torch.randn(512, 512)
    torch.randn(1 << 22).exp().sum()
    out["openmp"] = fork_hazard()
    print(json.dumps(out))
""")


def run_python(path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pagedllm forks its workers on Linux only")


@LINUX_ONLY
def test_fork_hazards(tmp_path: Path) -> None:
    script = tmp_path / "hazards.py"
    script.write_text(HAZARDS)
    proc = run_python(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["fresh"] is None and out["fresh_method"] == "fork"
    assert "sleeper" in out["python_thread"]
    assert out["thread_joined"] is None
    assert out["tqdm_monitor"] == [["MainThread", "tqdm_monitor"], None]  # it never touches what a worker uses
    assert out["openblas"] is None
    assert "native threads" in out["openmp"]


MAIN_LINES = textwrap.dedent("""\
    import json
    from pagedllm.executor.start_method import unguarded_main_line

    def nested():
        return unguarded_main_line()

    out = {"top": unguarded_main_line(), "via_function": nested()}
    if __name__ == "__main__":
        out["guarded"] = unguarded_main_line()
        out["guarded_function"] = nested()
    print(json.dumps(out))
""")


def test_unguarded_main_line(tmp_path: Path) -> None:
    script = tmp_path / "lines.py"
    script.write_text(MAIN_LINES)
    proc = run_python(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["top"] == out["via_function"] == f"{script}, line 7"
    assert out["guarded"] is None and out["guarded_function"] is None
    # Not a script: spawn runs no main again
    code = "from pagedllm.executor.start_method import unguarded_main_line as u; print(u())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.strip() == "None", proc.stderr[-3000:]


@LINUX_ONLY
def test_spawn_refused_for_an_unguarded_script(tmp_path: Path) -> None:
    """A thread that forking leaves behind is running: spawn it would be, and the script's top
    level would run again, so the check says what to change, in one line."""
    script = tmp_path / "spawn.py"
    script.write_text(textwrap.dedent("""\
        import threading
        from pagedllm.executor.start_method import process_context
        threading.Thread(target=threading.Event().wait, daemon=True, name="busy").start()
        process_context("the test's workers")
    """))
    proc = run_python(script)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedllm.executor.start_method.UnguardedMainError: the test's workers would be spawned")
    assert "other Python threads run (busy)" in last and f"{script}, line 4 again" in last
    assert 'if __name__ == "__main__":' in last
