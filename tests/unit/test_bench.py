"""`pagedllm bench`: workloads, scheduler and memory benches, serve metrics and client, CLI runs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from pagedllm.benchmarks.memory import run_memory_bench
from pagedllm.benchmarks.scheduler import time_scheduler
from pagedllm.benchmarks.serve_metrics import RequestResult, compute_metrics, summarize_ms
from pagedllm.benchmarks.workloads import (
    VocabInfo,
    load_dataset,
    parse_range,
    random_workload,
    shared_prefix_workload,
)

VOCAB = VocabInfo(1000, frozenset({0, 1, 2, 999}))


@pytest.fixture(autouse=True)
def short_peak_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' matmul peaks timed for 0.2 s (copy bandwidth 0.1 s) instead of 2 s: these
    tests check the reports' shape and signs, not the peaks' values."""
    monkeypatch.setenv("PAGEDLLM_BENCH_PEAK_SECONDS", "0.2")


def test_random_workload_is_seeded_and_respects_ranges() -> None:
    a = random_workload(50, (8, 20), (3, 9), VOCAB, seed=1)
    b = random_workload(50, (8, 20), (3, 9), VOCAB, seed=1)
    c = random_workload(50, (8, 20), (3, 9), VOCAB, seed=2)
    assert a == b and a != c
    assert all(8 <= r.prompt_len <= 20 and 3 <= r.output_len <= 9 for r in a)
    ids = {t for r in a for t in r.prompt_token_ids}
    assert ids.isdisjoint(VOCAB.special_ids) and max(ids) < VOCAB.size
    # Both ends of the ranges are reachable.
    many = random_workload(400, (1, 3), (1, 2), VOCAB, seed=0)
    assert {r.prompt_len for r in many} == {1, 2, 3} and {r.output_len for r in many} == {1, 2}


def test_shared_prefix_and_dataset(tmp_path) -> None:
    reqs = shared_prefix_workload(8, 10, 2, (3, 5), (2, 4), VOCAB, seed=0)
    assert reqs[0].prompt_token_ids[:10] == reqs[2].prompt_token_ids[:10]
    assert reqs[0].prompt_token_ids[:10] != reqs[1].prompt_token_ids[:10]
    assert all(13 <= r.prompt_len <= 15 for r in reqs)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps([{"prompt_token_ids": [5, 6], "output_len": 3}, {"prompt_token_ids": [7], "max_tokens": 1}]))
    ds = load_dataset(str(path))
    assert [(r.prompt_len, r.output_len) for r in ds] == [(2, 3), (1, 1)]
    path.write_text(json.dumps([{"prompt_token_ids": [], "output_len": 3}]))
    with pytest.raises(ValueError, match="entry 0"):
        load_dataset(str(path))
    assert parse_range("32:512", "x") == (32, 512)
    with pytest.raises(ValueError, match="LOW <= HIGH"):
        parse_range("9:3", "x")


def test_scheduler_bench_small() -> None:
    r = time_scheduler(16, 20, input_range=(8, 32), output_range=(4, 16), show_progress=False)
    assert r["mean_scheduled_requests"] == pytest.approx(16, abs=1)
    assert r["step_us_mean"] > 0 and r["requests_completed"] > 0
    assert r["schedule_us"] > 0 and r["update_us"] > 0
    assert r["step_us_median"] <= r["step_us_p99"]


def test_memory_bench_waste_is_sane() -> None:
    report = run_memory_bench([8, 16, 32, 64], 48, (16, 200), (8, 100), num_kv_tokens=8192, max_model_len=512,
                              max_num_seqs=64, show_progress=False)
    rows = report["results"]
    for r in rows:
        assert 0 <= r["paged_waste"] < r["contiguous_oracle_waste"] < r["contiguous_max_len_waste"] < 1
    wastes = [r["paged_waste"] for r in rows]
    assert wastes == sorted(wastes) and wastes[0] < wastes[-1]


def test_serve_metrics_on_synthetic_timings() -> None:
    s = summarize_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    results = [
        # ttft 0.1 s, 11 tokens over 1.1 s -> tpot 0.1 s
        RequestResult(True, 10, 11, ttft=0.1, latency=1.1, itl=[0.1] * 10),
        # ttft 0.5 s, 5 tokens over 0.9 s -> tpot 0.1 s
        RequestResult(True, 20, 5, ttft=0.5, latency=0.9, itl=[0.1] * 4),
        # ttft 0.2 s, 3 tokens over 1.2 s -> tpot 0.5 s
        RequestResult(True, 30, 3, ttft=0.2, latency=1.2, itl=[0.5, 0.5]),
        RequestResult(False, 40, error="HTTP 500: boom"),
    ]
    m = compute_metrics(results, duration_s=2.0, slo_ttft_ms=300, slo_tpot_ms=200)
    assert (m["completed"], m["failed"], m["errors"]) == (3, 1, ["HTTP 500: boom"])
    assert m["output_tokens"] == 19 and m["prompt_tokens"] == 60
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(9.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(800 / 3)
    assert m["tpot_ms"]["median"] == pytest.approx(100)
    assert m["itl_ms"]["median"] == pytest.approx(100)
    assert m["e2el_ms"]["p99"] == pytest.approx(1200 - 0.02 * 100, rel=1e-3)
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(0.5)  # only the first meets both SLOs
    assert "goodput" not in compute_metrics(results, 2.0)


def test_poisson_arrivals() -> None:
    from pagedllm.benchmarks.serve import arrival_offsets

    assert arrival_offsets(5, float("inf"), 0) == [0.0] * 5
    a = arrival_offsets(2000, 4.0, 0)
    assert a == arrival_offsets(2000, 4.0, 0) and a == sorted(a)
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)


STUB_BODIES: list[dict] = []  # the request bodies the stub server received


@pytest.fixture
def stub_server():
    """A tiny OpenAI-style streaming /v1/completions server: one chunk per token, usage at the end."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        STUB_BODIES.append(body)
        n = body["max_tokens"]
        if body.get("model") != "stub-model" or not body.get("ignore_eos"):
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)

        async def gen():
            for i in range(n):
                await asyncio.sleep(0.002)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_serve_client_against_stub(stub_server) -> None:
    from pagedllm.benchmarks.serve import run_serve_bench

    reqs = random_workload(6, (4, 8), (2, 5), VOCAB, seed=0)
    opts = {"request_rates": [50.0, float("inf")], "max_concurrency": 2, "seed": 0, "request_timeout": 30,
            "num_warmup": 1, "slo_ttft_ms": 10_000, "slo_tpot_ms": 10_000}
    report = run_serve_bench(stub_server, reqs, {"kind": "random"}, opts)
    assert report["served_model"] == "stub-model"
    for run in report["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0, run["errors"]
        assert run["output_tokens"] == sum(r.output_len for r in reqs)
        assert run["good_requests"] == 6 and run["ttft_ms"]["p99"] > 0 and run["itl_ms"]["median"] > 0
    assert [r["request_rate"] for r in report["runs"]] == [50.0, "inf"]


def test_serve_client_sends_the_sampling_settings(stub_server) -> None:
    from pagedllm.benchmarks.serve import run_serve_bench

    reqs = random_workload(3, (4, 8), (2, 3), VOCAB, seed=0)
    opts = {"request_rates": [float("inf")], "seed": 0, "request_timeout": 30, "num_warmup": 0}
    for sampling, fields in (
        (None, {"temperature": 0.0}),
        ({"temperature": 0.8, "top_p": 0.9, "top_k": 20}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}),
        ({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, {"temperature": 1.0}),  # no cut: not sent
    ):
        STUB_BODIES.clear()
        report = run_serve_bench(stub_server, reqs, {"kind": "random"}, opts | {"sampling": sampling})
        assert report["sampling"] == fields and report["runs"][0]["completed"] == 3
        for body in STUB_BODIES:
            assert {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body} == fields


def test_bench_throughput_pagedllm_end_to_end(tiny_model_dir, tmp_path, capsys) -> None:
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--backend", "pagedllm", "--model", tiny_model_dir, "--num-prompts", "4",
               "--input-len-range", "8:16", "--output-len-range", "4:8", "--dtype", "float32,bfloat16",
               "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["backend"], r["dtype"]) for r in rows] == [("pagedllm", "float32"), ("pagedllm", "bfloat16")]
    for row in rows:  # each dtype is its own baseline, against its own matmul peak
        assert row["ok"] and row["num_requests"] == 4
        assert row["output_tokens"] == report["workload"]["output_tokens"] and "warning" not in row
        assert row["output_tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_rss_bytes"] > 0
        assert row["startup_s"] > 0 and row["vs_pagedllm"]["output_tokens_per_s"] == pytest.approx(1.0)
    assert set(report["peak_matmul_flops_per_s_by_dtype"]) == {"float32", "bfloat16"}
    assert "bfloat16" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_throughput_sampled_in_every_backend(tiny_model_dir, tmp_path, capsys) -> None:
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "s.json"
    rc = main(["bench", "throughput", "--backend", "pagedllm", "--compare", "hf", "--model", tiny_model_dir,
               "--num-prompts", "4", "--input-len-range", "8:16", "--output-len-range", "4:8", "--hf-batch-sizes",
               "2", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    assert [(r["backend"], r["ok"]) for r in report["results"]] == [("pagedllm", True), ("hf", True)]
    for row in report["results"]:  # ignore_eos / min_new_tokens: exact lengths while sampling too
        assert row["output_tokens"] == report["workload"]["output_tokens"] and "warning" not in row
    assert "sampled at temperature 0.8, top-p 0.9, top-k 20" in capsys.readouterr().out


def test_bench_throughput_vllm_without_peers_venv(tiny_model_dir, tmp_path, capsys) -> None:
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "v.json"
    rc = main(["bench", "throughput", "--backend", "vllm", "--peers-venv", str(tmp_path / "no-venv"),
               "--model", tiny_model_dir, "--num-prompts", "2", "--input-len-range", "4:8", "--output-len-range",
               "2:4", "--output-json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["results"]
    assert not row["ok"] and "not installed" in row["reason"] and "make peers" in row["reason"]
    captured = capsys.readouterr()
    assert "skipped: vLLM's CPU build is not installed" in captured.out
    assert "Traceback" not in captured.err


def test_bench_latency_per_dtype_with_peers(tiny_model_dir, tmp_path, capsys) -> None:
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", tiny_model_dir, "--input-len", "8", "--output-len", "4",
               "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32,bfloat16",
               "--compare", "hf,llama.cpp", "--num-kv-blocks", "16", "--repeat", "2", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["dtype"] for r in report["runs"]] == ["float32", "bfloat16"]
    assert report["repeat"] == 2 and [[r["dtype"] for r in rows] for rows in report["rounds"]] == [
        ["float32", "bfloat16"]] * 2
    for row in report["runs"]:
        assert len(row["hf"]["pagedllm_prefill_speedup_rounds"]) == 2
    for row in report["runs"]:
        assert row["pagedllm"]["model"]["dtype"] == row["dtype"]
        assert 0 < row["pagedllm"]["decode_weight_fraction_of_peak_bw"]
        # the weight-read roofline: the read rate before and after the runs, averaged
        ours = row["pagedllm"]
        assert ours["read_bytes_per_s"]["before"] > 0 and ours["read_bytes_per_s"]["after"] > 0
        assert ours["peak_read_bytes_per_s"] == (ours["read_bytes_per_s"]["before"] + ours["read_bytes_per_s"]["after"]) / 2
        assert ours["decode_weight_fraction_of_read_bw"] == pytest.approx(
            ours["model"]["decode_weight_bytes"] / (ours["decode_ms_per_token"] / 1000) / ours["peak_read_bytes_per_s"])
        # A 4-token decode of a tiny model can be too short to time: then the ratio is None ('-').
        assert row["hf"]["ok"] and row["hf"]["pagedllm_prefill_speedup"] > 0
        assert row["hf"]["pagedllm_decode_speedup"] is None or row["hf"]["pagedllm_decode_speedup"] > 0
        # llama.cpp runs GGUF files only: a Hugging Face folder is skipped with the reason.
        assert not row["llama.cpp"]["ok"] and "GGUF" in row["llama.cpp"]["reason"]
    printed = capsys.readouterr().out
    assert "weight roofline" in printed and "float32 hf: decode" in printed and "2 rounds" in printed
    assert main(["bench", "latency", "--model", tiny_model_dir, "--repeat", "0"]) == 2
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err


def _latency_result(decode_ms: float, prefill_ms: float = 10.0) -> dict:
    return {"ok": True, "decode_ms_per_token": decode_ms, "prefill_ms": prefill_ms, "model": {"decode_weight_bytes": 8},
            "peak_copy_bytes_per_s": 1000.0}


def test_latency_rounds_pair_each_round_and_take_medians() -> None:
    """Speed-ups over rounds are the median of the same-round ratios (not a ratio of medians), each
    engine's row is its median round, and a peer that failed in one round reports that failure."""
    from pagedllm.benchmarks.latency import _against, summarize_rounds

    def row(ours_ms: float, peer_ms: float, peer_ok: bool = True) -> dict:
        ours = _latency_result(ours_ms)
        peer = _against(_latency_result(peer_ms) if peer_ok else {"ok": False, "reason": "gone"}, ours)
        return {"dtype": "float32", "dtype_requested": "float32", "pagedllm": ours, "llama.cpp": peer}

    # round by round: pagedllm 10, 20, 12 ms; peer 11, 30, 11 ms -> ratios 1.1, 1.5, 0.9167
    summary = summarize_rounds([[row(10, 11)], [row(20, 30)], [row(12, 11)]])
    (s,) = summary
    assert s["pagedllm"]["decode_ms_per_token"] == 12  # the median round of 10, 20, 12
    assert s["llama.cpp"]["decode_ms_per_token"] == 11
    assert s["llama.cpp"]["pagedllm_decode_speedup_rounds"] == pytest.approx([1.1, 1.5, 11 / 12])
    assert s["llama.cpp"]["pagedllm_decode_speedup"] == pytest.approx(1.1)  # not 11 / 12, the ratio of medians
    assert s["llama.cpp"]["pagedllm_prefill_speedup"] == pytest.approx(1.0)
    # even count: the lower middle round
    assert summarize_rounds([[row(10, 11)], [row(20, 30)]])[0]["pagedllm"]["decode_ms_per_token"] == 10
    failed = summarize_rounds([[row(10, 11)], [row(20, 30, peer_ok=False)]])[0]["llama.cpp"]
    assert failed == {"ok": False, "reason": "gone"}


def test_offline_baseline_runs_the_servers_engine_flags_on_the_workload(tiny_model_dir) -> None:
    from pagedllm.benchmarks.serve import run_offline_baseline, server_engine_args

    flags = ["--dtype", "float32", "--max-num-seqs", "3", "--port", "9", "--api-key", "k", "--kv-cache-memory", "64MiB"]
    ea = server_engine_args(tiny_model_dir, flags)  # server flags (--port, --api-key) are not the engine's
    assert (ea.model, ea.dtype, ea.max_num_seqs, ea.kv_cache_memory) == (tiny_model_dir, "float32", 3, 64 << 20)
    with pytest.raises(ValueError, match="--dtype"):
        server_engine_args(None, ["--dtype", "float13"])
    reqs = random_workload(4, (4, 8), (2, 5), VocabInfo(200, frozenset({0, 1, 2})), seed=0)
    off = run_offline_baseline(reqs, tiny_model_dir, flags)
    assert off["num_requests"] == 4 and off["output_tokens"] == sum(r.output_len for r in reqs)
    assert off["dtype"] == "float32" and off["output_tokens_per_s"] > 0 and off["engine_flags"].startswith("--dtype")


def test_offline_baseline_needs_a_launched_pagedllm_server(capsys) -> None:
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--offline-baseline"]) == 2
    assert "--offline-baseline compares the pagedllm server" in capsys.readouterr().err
    assert main(["bench", "serve", "--launch", "pagedllm", "--offline-baseline", "--server-args", "--dtype f13"]) == 2
    assert "--server-args '--dtype f13'" in capsys.readouterr().err


def test_each_request_rate_gets_prompts_with_no_cached_prefix_from_earlier_rates():
    from pagedllm.benchmarks.serve import rate_variant
    from pagedllm.benchmarks.workloads import BenchRequest

    reqs = [BenchRequest([5, 1, 2, 3], 7), BenchRequest([0, 9], 3), BenchRequest([], 2)]
    assert rate_variant(reqs, 0) is reqs
    seen = [[r.prompt_token_ids[:1] for r in rate_variant(reqs, i)] for i in range(3)]
    for i in range(3):
        v = rate_variant(reqs, i)
        assert [(len(r.prompt_token_ids), r.output_len) for r in v] == [(4, 7), (2, 3), (0, 2)]
        assert all(r.prompt_token_ids[1:] == o.prompt_token_ids[1:] for r, o in zip(v, reqs))
        assert all(0 <= t < 10 for r in v for t in r.prompt_token_ids)
    # every prompt's first block differs between rates
    assert all(seen[i][j] != seen[k][j] for j in range(2) for i in range(3) for k in range(i))


def test_decode_read_bytes_follow_the_model_storage(tiny_model_dir) -> None:
    """bench latency's weight roofline counts the bytes a decode step reads: for a dense model the
    decoder and the LM head (as the shape formula says, which leaves out the final norm), for a
    quantized one its codes, scales and zeros, and with --quantize-embeddings the head's codes."""
    from pagedllm import LLM
    from pagedllm.benchmarks.flops import ModelShape
    from pagedllm.benchmarks.latency import decode_read_bytes

    def read(**kw) -> tuple[int, ModelShape]:
        eng = LLM(model=tiny_model_dir, num_kv_blocks=16, **kw).llm_engine
        return decode_read_bytes(eng.core.executor.runner.model), ModelShape.from_hf_config(eng.model_config.hf_config)

    dense, shape = read(dtype="float32")
    assert shape.decode_weight_bytes(4) <= dense <= shape.decode_weight_bytes(4) + 4 * 1024
    assert read(dtype="bfloat16")[0] == dense // 2
    int8, _ = read(dtype="float32", quantization="int8")
    head = shape.embedding_params * 4  # untied: the head's float32 weight stays
    assert head < int8 < head + (dense - head) * 0.4
    from pagedllm.quantization.native import load_quant_kernel

    if load_quant_kernel() is not None:  # --quantize-embeddings needs the native quantized kernel (AVX-512 BF16)
        codes_only, _ = read(dtype="float32", quantization="int8", quantize_embeddings=True)
        assert codes_only < int8 - head * 0.6


@pytest.mark.slow
def test_repeat_rounds_report_each_ratio_and_the_median(tiny_model_dir, tmp_path, capsys) -> None:
    """`--repeat 2 --offline-baseline`: two rounds, each with its own server run and offline run,
    and the median of the server/offline ratios in the summary."""
    import statistics

    from pagedllm.entrypoints.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--launch", "pagedllm", "--model", tiny_model_dir, "--repeat", "2",
               "--offline-baseline", "--num-prompts", "3", "--input-len-range", "4:8", "--output-len-range", "2:4",
               "--server-args", "--num-kv-blocks 64", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["repeat"] == 2 and len(report["rounds"]) == 2
    ratios = []
    for rnd in report["rounds"]:
        (server,) = rnd["servers"]
        assert server["runs"][0]["completed"] == 3 and server["offline"]["num_requests"] == 3
        (x,) = server["offline_ratio"]
        assert x["exact_tokens"]
        ratios.append(x["output_throughput"])
    (summary,) = report["summary"]["offline_ratio"]
    assert summary["per_round"] == ratios and summary["median"] == pytest.approx(statistics.median(ratios), abs=1e-3)
    assert "over 2 rounds" in capsys.readouterr().out


def test_repeat_summary_of_two_servers() -> None:
    from pagedllm.benchmarks.serve import repeat_summary

    def report(name: str, tok_s: float, ttft: float) -> dict:
        run = {"request_rate": "inf", "output_throughput": tok_s, "ttft_ms": {"mean": ttft}, "tpot_ms": {"mean": 10.0},
               "itl_ms": {"median": 9.0}, "goodput": None}
        return {"server": name, "runs": [run], "server_peak_rss_bytes": 100}

    rounds = [[report("a", 300, 100), report("b", 200, 200)], [report("a", 330, 90), report("b", 300, 100)],
              [report("a", 120, 50), report("b", 100, 100)]]
    (row,) = repeat_summary(rounds)["ratios"]
    assert row["servers"] == "a/b" and row["output_throughput"]["per_round"] == [1.5, 1.1, 1.2]
    assert row["output_throughput"]["median"] == 1.2 and row["mean_ttft"]["median"] == 0.5
    assert row["goodput"] == {"per_round": [None, None, None], "median": None}
    assert repeat_summary(rounds)["offline_ratio"] == []


def test_repeat_needs_launch(capsys) -> None:
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--repeat", "2"]) == 2
    assert "--repeat relaunches" in capsys.readouterr().err
    assert main(["bench", "serve", "--launch", "pagedllm", "--repeat", "0"]) == 2
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err


def test_launched_server_stop_waits_for_its_whole_process_group(tmp_path):
    """A launched server's stop() returns only once every process of its group is gone: a child that
    outlives the server's main process (as vLLM's engine core does while it shuts down) would
    otherwise share the cores with the next server's start-up."""
    import subprocess

    from pagedllm.benchmarks.serve import LaunchedServer, _group_gone

    marker = tmp_path / "child-done"
    # The leader exits at once on SIGTERM; its child ignores SIGTERM and lives on for 1.5 s.
    script = f"(trap '' TERM; sleep 1.5; touch {marker}) & trap 'exit 0' TERM; while :; do sleep 0.05; done"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    time.sleep(0.3)
    assert not _group_gone(proc.pid, timeout=0.1)
    server = LaunchedServer.__new__(LaunchedServer)
    server.monitor, server.proc = None, proc
    t0 = time.monotonic()
    server.stop()
    assert proc.poll() is not None and _group_gone(proc.pid, timeout=0)
    assert marker.exists() and time.monotonic() - t0 >= 1.0  # it waited for the child, not just the leader
