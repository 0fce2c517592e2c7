"""`pagedllm bench embed-mixed` end to end on a tiny random decoder (a few requests, one round):
every generation and embedding request completes in both phases and the report holds the figures."""

from __future__ import annotations

import json

from pagedllm.benchmarks.embed_mixed import arrivals, main


def test_arrivals_are_seeded_and_increasing() -> None:
    a = arrivals(20, 4.0, seed=3)
    assert a == arrivals(20, 4.0, seed=3) and a == sorted(a) and a[0] > 0


def test_embed_mixed_reports_tpot_alone_and_mixed(tiny_model_dir: str, tmp_path, capsys) -> None:
    out = tmp_path / "mixed.json"
    main(["--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--num-requests", "4",
          "--request-rate", "20", "--embed-rate", "40", "--output-len", "4", "--prompt-words", "8", "--rounds", "1",
          "--output-json", str(out)])
    report = json.loads(out.read_text())
    (r,) = report["rounds"]
    assert r["alone"]["generation_requests"] == r["mixed"]["generation_requests"] == 4
    assert r["alone"]["embedding_requests"] == 0 and r["mixed"]["embedding_requests"] == report[
        "embedding_requests_per_phase"] > 0
    assert report["mean_tpot_alone_ms"] > 0 and report["ratio"] == report["mean_tpot_mixed_ms"] / report[
        "mean_tpot_alone_ms"]
    assert "mean TPOT of the generation requests" in capsys.readouterr().out
