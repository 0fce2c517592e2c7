"""run-batch's files without a model: reading the input (path, URL), resuming an output file (a cut
last line, counts per custom_id), which lines still run, and the lines refused before the engine."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from pagedllm.entrypoints.openai.batch_files import OutputWriter, read_input, resume_output
from pagedllm.entrypoints.openai.run_batch import SUPPORTED_URLS, output_line, parse_lines, still_to_run


def line(custom_id: str, url: str = "/v1/completions", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "x"}, **extra})


def test_input_from_an_http_url_keeps_unicode_line_separators() -> None:
    text = line("a") + "\n" + json.dumps({"custom_id": "b\u2028c"}, ensure_ascii=False) + "\r\n"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            data = text.encode() if self.path == "/in.jsonl" else b""
            self.send_response(200 if data else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert read_input(base + "/in.jsonl") == [line("a"), json.dumps({"custom_id": "b\u2028c"}, ensure_ascii=False), ""]
        with pytest.raises(ValueError, match="answered HTTP 404"):
            read_input(base + "/missing.jsonl")
    finally:
        server.shutdown()


def test_resume_cuts_a_partial_last_line_and_counts_per_custom_id(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    writer = OutputWriter(str(out))
    for cid in ("a", None, "b", "a"):
        writer.write(output_line(cid, 200, {"id": "x"}))
    writer.close()
    whole = out.read_text()
    out.write_text(whole + output_line("c", 200, {})[:30])
    assert resume_output(str(out)) == {"a": 2, None: 1, "b": 1}
    assert out.read_text() == whole
    out.write_text(whole + "not a batch line\n")
    with pytest.raises(ValueError, match="line 5 is not a batch output line"):
        resume_output(str(out))
    assert resume_output(str(tmp_path / "new.jsonl")) == {}


def test_lines_refused_before_the_engine_and_what_a_rerun_skips() -> None:
    raw = [line("a"), "{broken", "", line("b", url="/v1/nothing"), line("a"), line("c", method="GET"),
           json.dumps({"custom_id": 7}), line("d", extra=1), line("e"), "[1]"]
    lines = parse_lines(raw, SUPPORTED_URLS)
    assert [x.number for x in lines] == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # the blank line is skipped
    errors = {x.number: x.error.message for x in lines if x.error is not None}
    assert sorted(errors) == [2, 4, 5, 6, 7, 8, 10]
    assert errors[2].startswith("line 2: malformed JSON")
    assert '"/v1/nothing" is not supported' in errors[4]
    assert "already used by line 1" in errors[5]
    assert 'method must be "POST", got "GET"' in errors[6]
    assert "custom_id must be a non-empty string, got 7" in errors[7]
    assert "unknown fields ['extra']" in errors[8]
    assert "must be a JSON object, got list" in errors[10]
    # An output holding one line for "a", one without a custom_id and "e": the rest still run,
    # the repeated "a" among them.
    left = still_to_run(lines, {"a": 1, None: 1, "e": 1})
    assert [x.number for x in left] == [4, 5, 6, 7, 8, 10]
