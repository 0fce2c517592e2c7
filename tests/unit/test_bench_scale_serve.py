"""`pagedllm bench scale`'s served part: run rows, pagedllm-over-vLLM ratios and the report section
from serve reports built of hand-made request timings (expected figures computed by hand)."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.report_scale import _serve
from pagedllm.benchmarks.scale_serve import parse_rates, serve_ratios, summarize
from pagedllm.benchmarks.serve_metrics import RequestResult, compute_metrics, summarize_ms


def _report(engine: str, ttfts: list[float], latency: float, tokens: int, duration: float, rate: object) -> dict:
    results = [RequestResult(ok=True, prompt_len=10, output_tokens=tokens, ttft=t, latency=latency) for t in ttfts]
    m = compute_metrics(results, duration) | {"request_rate": rate, "max_concurrency": None}
    return {"benchmark": "serve", "server": engine, "runs": [m], "server_startup_s": 12.5,
            "server_peak_rss_bytes": 3 * 2**30, "server_command": f"{engine} serve"}


def test_summarize_ms_has_p95() -> None:
    s = summarize_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms: p95 at rank 0.95 * 99 = 94.05 -> 95.05
    assert s["p95"] == pytest.approx(95.05)
    assert summarize_ms([])["p95"] is None


def test_rows_and_ratios() -> None:
    # pagedllm: 4 requests, 11 tokens each in 2 s; TTFTs 0.1..0.4 s; latency 1.1 s -> TPOT (1.1 - t) / 10
    ours = _report("pagedllm", [0.1, 0.2, 0.3, 0.4], 1.1, 11, 2.0, "inf")
    theirs = _report("vllm", [0.2, 0.4, 0.6, 0.8], 2.2, 11, 4.0, "inf")
    servers, runs = summarize({"pagedllm": ours, "vllm": theirs})
    assert [s["engine"] for s in servers] == ["pagedllm", "vllm"] and all(s["ok"] for s in servers)
    assert servers[0]["startup_s"] == 12.5 and servers[0]["peak_rss_bytes"] == 3 * 2**30
    a, b = runs
    assert (a["engine"], a["request_rate"], a["completed"], a["failed"]) == ("pagedllm", "inf", 4, 0)
    assert a["output_tokens_per_s"] == pytest.approx(44 / 2.0) and b["output_tokens_per_s"] == pytest.approx(44 / 4.0)
    assert a["ttft_mean_ms"] == pytest.approx(250.0)
    assert a["ttft_p95_ms"] == pytest.approx(100 * (3 + 0.85))  # rank 0.95 * 3 = 2.85: 300 + 0.85 * 100 ms
    assert a["tpot_mean_ms"] == pytest.approx((1100 - 250) / 10)
    assert a["tpot_p95_ms"] == pytest.approx((1100 - 100 - 0.15 * 100) / 10)  # largest TPOTs at the smallest TTFTs
    (r,) = serve_ratios(runs)
    assert r["request_rate"] == "inf"
    assert r["output_speedup_vs_vllm"] == pytest.approx(2.0)
    assert r["ttft_mean_speedup_vs_vllm"] == pytest.approx(2.0) and r["ttft_p95_speedup_vs_vllm"] == pytest.approx(2.0)
    assert r["tpot_mean_speedup_vs_vllm"] == pytest.approx((2200 - 500) / (1100 - 250))

    text = _serve({"workload": {"num_requests": 4, "input_len_range": [32, 512], "output_len_range": [16, 256]},
                   "server_args": "--dtype bfloat16", "vllm_kv_cache_space_gib": 4, "servers": servers,
                   "runs": runs, "ratios": [r], "meta": None})
    assert "| pagedllm | inf | 4 | 22.0 | 250 | 385 | 85 | " in text
    assert "| vllm | inf | 4 | 11.0 | 500 | 770 | 170 | " in text
    assert "| inf | **2.00x** | **2.00x** | **2.00x** | **2.00x** |" in text
    assert "3.00 / 12.5" in text


def test_failed_launch_or_requests_give_no_ratio() -> None:
    ours = _report("pagedllm", [0.1, 0.2], 1.1, 11, 2.0, 1.0)
    servers, runs = summarize({"pagedllm": ours, "vllm": {"error": "the vllm server exited with code 1"}})
    assert servers[1] == {"engine": "vllm", "ok": False, "reason": "the vllm server exited with code 1"}
    assert [r["engine"] for r in runs] == ["pagedllm"] and serve_ratios(runs) == []
    text = _serve({"workload": {"num_requests": 2, "input_len_range": [32, 512], "output_len_range": [16, 256]},
                   "server_args": "", "vllm_kv_cache_space_gib": 4, "servers": servers, "runs": runs, "ratios": [],
                   "meta": None})
    assert "| pagedllm | 1 | 2 | " in text
    assert "not launched: the vllm server exited with code 1" in text and "pagedllm over vLLM" not in text

    failing = _report("vllm", [0.2], 2.2, 11, 4.0, 1.0)
    failing["runs"][0]["failed"] = 1
    assert serve_ratios(summarize({"pagedllm": ours, "vllm": failing})[1]) == []


@pytest.mark.parametrize("text", ["", "0", "-1,inf", "fast"])
def test_bad_rates(text: str) -> None:
    with pytest.raises(ValueError, match="--serve-request-rates"):
        parse_rates(text)


def test_rates() -> None:
    assert parse_rates("inf,1") == [float("inf"), 1.0]
