"""`pagedllm bench scale --rounds`: the one-stream part's bookkeeping over rounds (which engine goes
first, each engine's median round, the median of the same-round speed-ups, the median of the
rounds' fractions of the weight-read roofline) and its report section,
on engine results made by hand (the engines themselves run in test_bench_scale_model.py and
test_bench.py; expected figures computed by hand)."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.benchmarks import scale
from pagedllm.benchmarks.report_scale import _single_stream, roofline_fraction


def _result(ms: float, read_fraction: float = 0.9) -> dict:
    return {"ok": True, "decode_ms_per_token": ms, "decode_tokens_per_s": 1e3 / ms, "prefill_ms": 50.0,
            "decode_weight_fraction_of_read_bw": read_fraction, "decode_weight_fraction_of_peak_bw": 0.8,
            "peak_read_bytes_per_s": 30e9, "peak_copy_bytes_per_s": 25e9, "startup_s": 2.0, "peak_rss_bytes": 2**30,
            "model": {"decode_weight_bytes": 2.47e9}}


def test_rounds_alternate_and_take_medians(monkeypatch) -> None:
    ours_ms, peer_ms, calls = iter([100.0, 80.0, 90.0]), iter([110.0, 100.0, 80.0]), []

    def ours(spec, workdir, args):
        calls.append("pagedllm")
        return _result(next(ours_ms))

    def peer(folder, gguf, n, args):
        calls.append("llama.cpp")
        return _result(next(peer_ms))

    monkeypatch.setattr(scale, "_ours", ours)
    monkeypatch.setattr(scale, "_llamacpp", peer)
    args = argparse.Namespace(input_len=32, output_len=8, num_iters=1, num_iters_warmup=0, pairs=["bf16"], rounds=3,
                              skip_llamacpp=False)
    part = scale.run_latency_part("folder", {"BF16": {"ok": True, "path": "m.gguf"}}, args)
    assert calls == ["pagedllm", "llama.cpp", "llama.cpp", "pagedllm", "pagedllm", "llama.cpp"]
    row = part["rows"][0]
    assert part["rounds"] == 3 and [r["first"] for r in row["rounds"]] == ["pagedllm", "llama.cpp", "pagedllm"]
    # Each engine's median round: 90 ms (of 100, 80, 90) and 100 ms (of 110, 100, 80).
    assert row["pagedllm"]["decode_ms_per_token"] == 90.0 and row["llama.cpp"]["decode_ms_per_token"] == 100.0
    # Same-round speed-ups 1.1, 1.25, 0.889: their median, not the ratio of the medians (1.111).
    assert [r["decode_speedup_vs_llamacpp"] for r in row["rounds"]] == pytest.approx([1.1, 1.25, 80 / 90])
    assert row["decode_speedup_vs_llamacpp"] == pytest.approx(1.1)
    text = _single_stream(part)
    assert "3 rounds alternating which engine runs first" in text and "**1.10x**" in text
    assert "bf16 against BF16, round by round: 10.00 / 9.09 tok/s (1.10x, pagedllm first)" in text


def test_roofline_fraction_is_the_median_of_the_rounds_fractions(monkeypatch) -> None:
    """Each round's fraction is of the read rate measured around that round; the row's is their
    median (0.89 of 0.89, 0.76, 1.06), not the median round's own (by decode time the 0.76 one)."""
    ours = iter([_result(100.0, 0.89), _result(90.0, 0.76), _result(80.0, 1.06)])
    monkeypatch.setattr(scale, "_ours", lambda spec, workdir, args: next(ours))
    monkeypatch.setattr(scale, "_llamacpp", lambda folder, gguf, n, args: _result(100.0))
    args = argparse.Namespace(input_len=32, output_len=8, num_iters=1, num_iters_warmup=0, pairs=["bf16"], rounds=3,
                              skip_llamacpp=False)
    part = scale.run_latency_part("folder", {"BF16": {"ok": True, "path": "m.gguf"}}, args)
    row = part["rows"][0]
    assert row["pagedllm"]["decode_ms_per_token"] == 90.0
    assert row["pagedllm"]["decode_weight_fraction_of_read_bw"] == 0.76
    assert [r["pagedllm_fraction_of_weight_roofline"] for r in row["rounds"]] == [0.89, 0.76, 1.06]
    assert row["pagedllm_fraction_of_weight_roofline"] == 0.89
    text = _single_stream(part)
    assert "median of the rounds' fractions" in text
    assert "| 89 %, median of the rounds' fractions (2.47 GB); the median round 76 % of 30.0 GB/s read, " in text
    # A result written when the row held the median round's own fraction: the report takes the
    # median from the rounds stored in it.
    old = {**part, "rows": [{**row, "pagedllm_fraction_of_weight_roofline": 0.76}]}
    assert roofline_fraction(old["rows"][0]) == 0.89 and _single_stream(old) == text
    # Without rounds (one round, or none recorded) the row's own fraction.
    assert roofline_fraction({k: v for k, v in old["rows"][0].items() if k != "rounds"}) == 0.76


def test_one_round_and_a_failed_run(monkeypatch) -> None:
    monkeypatch.setattr(scale, "_ours", lambda spec, workdir, args: _result(50.0))
    monkeypatch.setattr(scale, "_llamacpp", lambda folder, gguf, n, args: {"ok": False, "reason": "no GGUF"})
    args = argparse.Namespace(input_len=32, output_len=8, num_iters=1, num_iters_warmup=0, pairs=["bf16"], rounds=2,
                              skip_llamacpp=False)
    row = scale.run_latency_part("folder", {"BF16": {"ok": False, "reason": "no GGUF"}}, args)["rows"][0]
    assert row["pagedllm"]["decode_ms_per_token"] == 50.0 and row["llama.cpp"] == {"ok": False, "reason": "no GGUF"}
    assert "decode_speedup_vs_llamacpp" not in row and "rounds" not in row
    # One round: its own fraction, in the cell as before rounds existed.
    monkeypatch.setattr(scale, "_ours", lambda spec, workdir, args: _result(50.0, 0.93))
    monkeypatch.setattr(scale, "_llamacpp", lambda folder, gguf, n, args: _result(60.0))
    one = scale.run_latency_part("folder", {"BF16": {"ok": True, "path": "m.gguf"}},
                                 argparse.Namespace(**{**vars(args), "rounds": 1}))
    assert one["rows"][0]["pagedllm_fraction_of_weight_roofline"] == 0.93 and "rounds" not in one["rows"][0]
    assert "| 93 % of 30.0 GB/s read (2.47 GB); 80 % of 25.0 GB/s copy |" in _single_stream(one)
    from pagedllm.benchmarks.latency import median_round

    assert median_round([_result(3.0), _result(1.0), _result(2.0), _result(4.0)])["decode_ms_per_token"] == 2.0


def test_rounds_flag_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        scale.main(["--shape", "llama-3.2-1b", "--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be at least 1, got 0" in capsys.readouterr().err
