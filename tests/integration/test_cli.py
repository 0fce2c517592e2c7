"""`pagedllm generate | chat` as a user runs them: real subprocesses on the default model (and, for
the argument checks that need no process of their own, `main()` in this process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Keep the KV cache small: the default (30% of free memory, up to 4 GiB) takes seconds to allocate.
SMALL_ENGINE = ["--kv-cache-memory", "256MiB", "--max-model-len", "1024"]


def pagedllm_command() -> list[str]:
    script = Path(sys.executable).with_name("pagedllm")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # One torch thread: on shared cores, waiting OpenMP threads make small CPU steps much slower.
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [*pagedllm_command(), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_generate_answers_and_reports_throughput() -> None:
    res = run_cli("generate", "What is the capital of France?", "--max-tokens", "24", *SMALL_ENGINE)
    assert res.returncode == 0, res.stderr
    assert "Answer:" in res.stdout and "Paris" in res.stdout, res.stdout
    assert re.search(r"1 prompts: \d+ prompt tokens, \d+ output tokens in [\d.]+ s \([\d.]+ output tokens/s",
                     res.stderr), res.stderr


# (args, fragment the one line names, whether it runs as its own process): one process per command
# and per path to the error (argparse, model resolution), the other cases call `main()` here.
BAD_ARGUMENTS = {
    "unknown-flag": (["generate", "Hi", "--no-such-flag"], "--no-such-flag", True),
    "negative-temperature": (["generate", "Hi", "--temperature", "-1"], "-1", False),
    "missing-model": (["generate", "Hi", "--model", "/nonexistent"], "/nonexistent", True),
    "non-integer-max-tokens": (["generate", "Hi", "--max-tokens", "abc"], "abc", False),
    "chat-top-p": (["chat", "--top-p", "0"], "top_p", False),
    "bench-top-p": (["bench", "throughput", "--top-p", "1.5"], "top_p", True),
}


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`main(args)` in this process, as the console script runs it: (exit status, stdout, stderr)."""
    from pagedllm.entrypoints.cli import main

    try:
        rc = main(args)
    except SystemExit as e:  # argparse's errors and --help
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_exit_2_with_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, fragment, own_process = BAD_ARGUMENTS[name]
    if own_process:
        res = run_cli(*args, timeout=60)
        rc, out, err = res.returncode, res.stdout, res.stderr
    else:
        rc, out, err = run_main(args, capsys)
    assert rc == 2, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0] and fragment in lines[0], lines[0]
    assert out == ""


@pytest.mark.slow  # test_chat_survives_a_turn_it_cannot_take also checks a reply and the exit
def test_chat_replies_then_exits() -> None:
    res = run_cli("chat", "--max-tokens", "24", *SMALL_ENGINE, stdin="What is the capital of France?\n/exit\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip(), res.stderr
    assert "Paris" in res.stdout, res.stdout


def test_chat_survives_a_turn_it_cannot_take() -> None:
    # The first message alone exceeds max_model_len: that turn fails with one line, the next is answered.
    long = "word " * 300
    res = run_cli("chat", "--max-tokens", "16", *SMALL_ENGINE, "--max-model-len", "256",
                  stdin=f"{long}\nWhat is the capital of France?\n/exit\n")
    assert res.returncode == 0, res.stderr
    assert "maximum context length is 256" in res.stderr
    assert "Paris" in res.stdout, res.stdout


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["chat", "--help"]])
def test_help_exits_0(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if args == ["--help"]:  # the console script's own process; the subcommands' help in this one
        res = run_cli(*args, timeout=60)
        rc, out, err = res.returncode, res.stdout, res.stderr
    else:
        rc, out, err = run_main(args, capsys)
    assert rc == 0, err
    assert "usage:" in out
    if "generate" in args:
        assert "--max-tokens" in out and "--kv-cache-memory" in out
