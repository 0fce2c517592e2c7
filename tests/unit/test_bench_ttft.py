"""`pagedllm bench ttft`: guidellm's command line, the figures read from its JSON report, ratios,
the table, and the flags it refuses. No server, no guidellm run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.benchmarks import ttft


def level(streams: int, ttft_mean: float, out_tps: float) -> dict:
    def stat(mean: float, p95: float | None = None) -> dict:
        return {"successful": {"mean": mean, "percentiles": {"p95": p95 if p95 is not None else mean * 1.5}}}

    return {
        "duration": 30.0,
        "config": {"strategy": {"type_": "concurrent", "streams": streams}},
        "metrics": {
            "request_totals": {"successful": 10 * streams},
            "requests_per_second": stat(out_tps / 64),
            "output_tokens_per_second": stat(out_tps),
            "time_to_first_token_ms": stat(ttft_mean, 2 * ttft_mean),
            "time_per_output_token_ms": stat(20.0),
            "inter_token_latency_ms": stat(18.0),
            "request_latency": stat(1.5),
        },
    }


def test_guidellm_report_is_read_per_level() -> None:
    rows = ttft.parse_guidellm({"benchmarks": [level(1, 100.0, 50.0), level(16, 800.0, 200.0)]})
    assert [r["streams"] for r in rows] == [1, 16]
    r = rows[1]
    assert (r["completed"], r["ttft_mean_ms"], r["ttft_p95_ms"], r["output_tok_s"]) == (160, 800.0, 1600.0, 200.0)
    assert (r["tpot_mean_ms"], r["itl_mean_ms"], r["latency_mean_s"]) == (20.0, 18.0, 1.5)


def test_a_level_with_no_completed_request_has_no_figures() -> None:
    empty = level(16, 0.0, 0.0)
    empty["metrics"]["request_totals"]["successful"] = 0
    (r,) = ttft.parse_guidellm({"benchmarks": [empty]})
    assert r["completed"] == 0 and r["ttft_mean_ms"] is None and r["output_tok_s"] is None
    assert "| pagedllm | 16 | 0 | - / - | - | - | - |" in ttft.format_table(
        {"engines": [{"engine": "pagedllm", "levels": [r]}]})


def test_ratios_and_table() -> None:
    a = {"engine": "pagedllm", "server_args": ["--dtype", "float32"],
         "levels": ttft.parse_guidellm({"benchmarks": [level(16, 600.0, 300.0)]})}
    b = {"engine": "vllm", "server_args": ["--dtype", "float32"],
         "levels": ttft.parse_guidellm({"benchmarks": [level(16, 800.0, 200.0)]})}
    rs = ttft.ratios([a, b])
    assert rs == [{"streams": 16, "output_tok_s": 1.5, "ttft_mean": 0.75}]
    text = ttft.format_table({"engines": [a, b], "ratios": rs})
    assert "| pagedllm | 16 | 160 | 600 / 1200 | 20.0 | 300.0 | 1.50 |" in text
    assert "| 16 | 1.50× | 0.75× |" in text


def test_guidellm_command_runs_one_sweep_for_a_fixed_time(tmp_path: Path) -> None:
    cmd = ttft.guidellm_command(Path("/g/bin/guidellm"), "http://127.0.0.1:9", "m", "/tok", [1, 4, 16], 20,
                                256, 64, tmp_path / "o.json")
    text = " ".join(cmd)
    assert "--profile kind=concurrent,streams=1 --override profile.streams 1,4,16" in text
    assert "kind=max_duration,seconds=20" in text and "request_format=/v1/chat/completions" in text
    assert "kind=synthetic_text,prompt_tokens=256,output_tokens=64" in text


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--streams", "a"], ["--engines", "tgi"],
                                  ["--seconds", "0"], ["--guidellm-venv", "/nonexistent"],
                                  ["--dtype", "pagedllm=bfloat16"], ["--dtype", "tgi=float32,pagedllm=auto"],
                                  ["--dtype", "pagedllm=,vllm=float32"]])
def test_bad_flags_exit_with_one_line(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert ttft.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_dtype_for_both_engines_or_per_engine() -> None:
    assert ttft.engine_dtypes("float32", ["pagedllm", "vllm"]) == {"pagedllm": "float32", "vllm": "float32"}
    assert ttft.engine_dtypes("pagedllm=auto,vllm=float32", ["pagedllm", "vllm"]) == {
        "pagedllm": "auto", "vllm": "float32"}
    with pytest.raises(ValueError, match="no dtype for vllm"):
        ttft.engine_dtypes("pagedllm=auto", ["pagedllm", "vllm"])
