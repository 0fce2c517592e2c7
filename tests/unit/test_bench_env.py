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


def test_git_commit_marks_changed_code_but_not_result_files(tmp_path):
    """A run that writes its result file into benchmarks/results/ leaves the next run's commit
    clean; a changed source file marks it `+dirty`."""
    import subprocess

    from pagedllm.benchmarks.env import git_commit

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "run.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    sha = git_commit(tmp_path)
    assert len(sha) == 12 and not sha.endswith("+dirty")
    (tmp_path / "benchmarks" / "results" / "run.json").write_text('{"a": 1}\n')
    assert git_commit(tmp_path) == sha
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == sha + "+dirty"
