"""`pagedllm run-batch` as a user runs it: a real subprocess on the default model, interrupted with
SIGINT and resumed, its bodies compared with what `pagedllm serve` answers for the same bodies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_helpers import Server, assert_error_shape
from test_cli import pagedllm_command, run_cli

# The engine flags of the shared default-model server (server_helpers.DEFAULT_SERVER_FLAGS).
ENGINE = ["--kv-cache-memory", "512MiB", "--dtype", "float32"]
OVER_CONTEXT = "hello " * 8300  # the default model's context is 8192 tokens
# Greedy, short: the batch is long enough to be interrupted part-way, short enough to stay fast.
GEN = {"max_tokens": 10, "temperature": 0}
TOPICS = ["the sea", "a cat", "rain", "bread", "the moon", "a train", "winter", "music", "a forest", "coffee",
          "a river", "chess"]


def request_lines() -> list[dict]:
    lines = []
    for i, topic in enumerate(TOPICS):
        lines.append({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": f"A short story about {topic}:", **GEN}})
        lines.append({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": [{"role": "user", "content": f"Write one line about {topic}."}], **GEN}})
    return lines


# Bodies the server refuses, and lines that are no request at all.
REFUSED = [
    {"custom_id": "bad-body", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": "many"}},
    {"custom_id": "over-context", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": OVER_CONTEXT, "max_tokens": 4}},
    {"custom_id": "chat-over-context", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": OVER_CONTEXT}], "max_tokens": 4}},
    {"custom_id": "bad-model", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}},
    {"custom_id": "bad-temperature", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}},
    {"custom_id": "lone-surrogate", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a\ud800b"}},
    {"custom_id": "embed-over-context", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["hi", OVER_CONTEXT]}},
]
# A generation model's pooling lines: its decoder embeds them (LAST pooling) as the server does.
POOLING = [
    {"custom_id": "embed-on-generate", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["hi", "there"]}},
    {"custom_id": "rerank-on-generate", "method": "POST", "url": "/v1/rerank",
     "body": {"query": "q", "documents": ["d", "e"]}},
]
NOT_REQUESTS = [
    '{"custom_id": "broken", "method": "POST", "url": "/v1/completions", "body": {"prompt": ',
    json.dumps({"custom_id": "unknown-url", "method": "POST", "url": "/v1/nothing", "body": {}}),
    json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}),
    json.dumps({"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "x", "stream": True}}),
    json.dumps({"custom_id": "cmpl-0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "again"}}),
]


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory):
    """Runs the batch file, interrupts it with SIGINT once 3 lines are written, cuts its last line
    in half (as a kill in the middle of a write would), then reruns it to the end (reading the
    batch file from stdin)."""
    d = tmp_path_factory.mktemp("batch")
    lines = [json.dumps(x) for x in request_lines()[:6]] + NOT_REQUESTS + [json.dumps(x) for x in REFUSED + POOLING]
    lines += [json.dumps(x) for x in request_lines()[6:]]
    src, out = d / "in.jsonl", d / "out.jsonl"
    src.write_text("\n".join(lines[:8]) + "\n\n" + "\n".join(lines[8:]) + "\n")  # a blank line is skipped
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*pagedllm_command(), "run-batch", "-i", str(src), "-o", str(out), *ENGINE]
    first = subprocess.Popen([*cmd, "--max-num-seqs", "2"], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            first.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    _, err1 = first.communicate(timeout=60)
    before = out.read_text()
    last = before.splitlines()[-1]
    out.write_text(before[: len(before) - len(last) - 1] + last[:40])
    second = run_cli("run-batch", "-i", "-", "-o", str(out), *ENGINE, stdin=src.read_text(), timeout=120)
    return {"lines": lines, "first": (first.returncode, err1), "before": before, "second": second,
            "out": [json.loads(x) for x in out.read_text().splitlines()], "src": src, "path": out}


@pytest.mark.slow
def test_interrupted_run_resumes_with_every_line_once(batch) -> None:
    rc, err = batch["first"]
    assert rc == 128 + signal.SIGINT, err[-2000:]
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"pagedllm run-batch: stopped by SIGINT: (\d+) of (\d+) lines remain; rerun the same "
                     r"command to resume", last)
    assert m, last
    total = len(batch["lines"])
    written = batch["before"].count("\n")
    assert int(m.group(2)) == total and int(m.group(1)) == total - written
    second = batch["second"]
    assert second.returncode == 0, second.stderr[-2000:]
    assert "partial line" in second.stderr
    out = batch["out"]
    # Every input line exactly once, in input order; the interrupted run's lines are kept as written.
    assert len(out) == total
    assert [json.dumps(x) for x in out[: written - 1]] == [
        json.dumps(json.loads(x)) for x in batch["before"].splitlines()[: written - 1]]
    assert out[written - 1]["custom_id"] == json.loads(batch["before"].splitlines()[-1])["custom_id"]
    expected_ids = []
    for raw in batch["lines"]:
        try:
            expected_ids.append(json.loads(raw)["custom_id"])
        except ValueError:
            expected_ids.append(None)
    assert [x["custom_id"] for x in out] == expected_ids
    # Nothing left: a third run loads no model and says so.
    third = run_cli("run-batch", "-i", str(batch["src"]), "-o", str(batch["path"]), *ENGINE, timeout=60)
    assert third.returncode == 0 and f"all {total} lines are in" in third.stderr, third.stderr


@pytest.mark.slow
def test_lines_that_are_no_request_get_a_400_line(batch) -> None:
    by_number = {i: x for i, x in enumerate(batch["out"])}
    texts = {}
    for i, raw in enumerate(batch["lines"]):
        if raw in NOT_REQUESTS:
            line = by_number[i]
            assert line["response"]["status_code"] == 400
            assert_error_shape(line["response"]["body"])
            assert line["error"]["message"] == line["response"]["body"]["error"]["message"]
            texts[line["custom_id"]] = line["error"]["message"]
    assert "malformed JSON" in texts[None]
    assert '"/v1/nothing" is not supported' in texts["unknown-url"]
    assert 'method must be "POST"' in texts["get"]
    assert "stream is not supported" in texts["streamed"]
    assert "already used by line 1" in texts["cmpl-0"]
    assert all(re.match(r"line \d+: ", t) for k, t in texts.items() if k != "streamed")


@pytest.mark.slow
def test_bodies_are_what_the_server_answers(batch, default_server: Server) -> None:
    sent = {json.loads(raw)["custom_id"]: json.loads(raw) for raw in batch["lines"] if raw not in NOT_REQUESTS}
    out: dict = {}
    for x in batch["out"]:  # the first line of a custom_id (the repeated one is refused)
        if x["custom_id"] in sent:
            out.setdefault(x["custom_id"], x)
    assert len(out) == len(sent) == len(TOPICS) * 2 + len(REFUSED) + len(POOLING)
    with default_server.http() as http, ThreadPoolExecutor(8) as pool:
        answers = pool.map(lambda line: http.post(line["url"], content=json.dumps(line["body"]),
                                                  headers={"Content-Type": "application/json"}), sent.values())
        for (custom_id, line), r in zip(sent.items(), answers):
            got = out[custom_id]["response"]
            assert got["status_code"] == r.status_code, (custom_id, got, r.text)
            want = r.json()
            if r.status_code == 200 and "choices" not in want:  # pooling: values within 1e-5 (other batches)
                assert got["request_id"] == got["body"]["id"] and out[custom_id]["error"] is None
                for body in (got["body"], want):
                    body.pop("id"), body.pop("created", None)
                for item in want.get("data", []):
                    item["embedding"] = pytest.approx(item["embedding"], abs=1e-5)
                for item in want.get("results", []):
                    item["relevance_score"] = pytest.approx(item["relevance_score"], abs=1e-5)
                assert want == got["body"], custom_id
                continue
            if r.status_code == 200:
                assert got["request_id"] == got["body"]["id"]
                assert out[custom_id]["error"] is None
                for body in (got["body"], want):  # and the prefix cache's hits, which depend on its history
                    body.pop("id"), body.pop("created"), body["usage"].pop("prompt_tokens_details")
                assert got["body"]["choices"][0]["finish_reason"] == "length"
            else:
                assert out[custom_id]["error"] == {"code": want["error"]["code"] or want["error"]["type"],
                                                   "message": want["error"]["message"]}
            assert got["body"] == want, custom_id


def test_bad_output_target_input_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli import build_parser, main

    assert main(["run-batch", "-i", "-", "-o", "https://example.com/out.jsonl"]) == 2
    assert "the output must be a local file or -" in capsys.readouterr().err
    assert main(["run-batch", "-i", "/nonexistent/in.jsonl", "-o", "-"]) == 2
    assert "cannot read the input file '/nonexistent/in.jsonl'" in capsys.readouterr().err
    assert "{serve,run-batch,generate,chat,bench,eval,simulate}" in build_parser().format_usage()
