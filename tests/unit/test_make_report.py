"""The benchmark report renders from the committed results (a broken section fails here, not
when someone next regenerates docs/benchmarks.md), and docs/benchmarks.md is what they give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_benchmarks_md_is_generated_from_the_committed_results():
    """docs/benchmarks.md equals `pagedllm bench report`'s text (plots are drawn only by the command)."""
    from pagedllm.benchmarks.report import DOC, render

    assert DOC.read_text() == render(draw=False), (
        "docs/benchmarks.md differs from what benchmarks/results gives: run `pagedllm bench report` "
        "(edit benchmarks/results/*.md or pagedllm/benchmarks/report*.py, not the page)")


def test_page_names_no_checkout_path():
    """Runs record the paths they were given; the page shows a checkout's virtual environments by
    their names inside any checkout, so it renders the same wherever the repository was cloned."""
    from pagedllm.benchmarks.report_render import checkout_relative, command

    assert checkout_relative("/srv/a b/x") == "/srv/a b/x"
    assert (checkout_relative("/home/u/pagedllm/.venv-peers/bin/python -m vllm --model /root/m")
            == ".venv-peers/bin/python -m vllm --model /root/m")
    assert (command({"command": "pagedllm bench ttft --peers-venv /work/co/.venv-peers --guidellm-venv "
                                "/work/co/.venv-guidellm --x 1"})
            == "pagedllm bench ttft --peers-venv .venv-peers --guidellm-venv .venv-guidellm --x 1")
    assert (command({"command": "/srv/wt/pagedllm/entrypoints/cli.py bench scale --merge"})
            == "pagedllm bench scale --merge")
    assert str(ROOT) + "/" not in (ROOT / "docs" / "benchmarks.md").read_text()


def test_headline_table_names_cpu_isa_and_commit_of_every_row():
    from pagedllm.benchmarks.report import RESULTS
    from pagedllm.benchmarks.report_headline import headline_rows

    rows = headline_rows(RESULTS)
    assert 0 < len(rows) <= 15
    for row in rows:
        meta = row["figure"].meta
        assert row["isa"] in ("AMX", "AVX-512 BF16", "AVX-512", "AVX2"), row["file"]
        assert meta.get("commit") and meta.get("time") and meta.get("command"), row["file"]


def test_report_command_writes_the_page(tmp_path):
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "report", "--no-plots",
                           "--doc", str(doc)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = doc.read_text()
    for name, heading in (("throughput.json", "## Offline throughput"), ("latency.json", "## Single-request latency"),
                          ("native_decode.json", "## Decode steps as one native call"),
                          ("prefill.json", "## Long-context prefill"),
                          ("amx_throughput.json", "### Offline throughput on the AMX host"),
                          ("amx_latency.json", "### Single-request latency on the AMX host"),
                          ("amx_float16_latency.json", "### float16 against bfloat16, one request, on the AMX host"),
                          ("amx_prefill.json", "### Long-context prefill on the AMX host"),
                          ("amx_prompt256_after_t2.json", "### Prompt steps of 256 tokens on the AMX host")):
        if (ROOT / "benchmarks" / "results" / name).exists():
            assert heading in text, heading


def _serve_run(rate: object, out_tps: float, out_tokens: int) -> dict:
    q = {"mean": 10.0, "median": 9.0, "p90": 12.0, "p99": 15.0}
    return {"request_rate": rate, "max_concurrency": None, "completed": 4, "failed": 0, "errors": [],
            "request_throughput": 0.5, "output_throughput": out_tps, "output_tokens": out_tokens,
            "ttft_ms": q, "tpot_ms": q, "itl_ms": q, "e2el_ms": q}


def _render(tmp_path: Path, name: str, data: dict) -> str:
    """docs/benchmarks.md as the report renders it from one results file `name` holding `data`."""
    results = tmp_path / "results"
    results.mkdir()
    (results / name).write_text(json.dumps(data))
    doc = tmp_path / "benchmarks.md"
    # The CLI's main() in this process: test_report_command_writes_the_page runs the command itself.
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "report", "--results", str(results), "--doc", str(doc), "--no-plots"]) == 0
    return doc.read_text()


def test_spec_section_shows_each_config_and_llamacpp(tmp_path):
    """A `bench spec --compare llama.cpp` result: each configuration against off, acceptance, the
    draft's pass time, whether greedy tokens matched, and llama.cpp's speculative runs with the
    ratios of pagedllm's off and best configuration against each."""
    def run(spec, tok_s, same=True, **extra):
        part = {"seconds": 1.0, "output_tokens": 100, "output_tok_s": tok_s}
        return {"speculative_config": spec, "single": part, "concurrent": dict(part, output_tok_s=0.0),
                "ratio": {"single": tok_s / 100.0, "concurrent": 0.0},
                "same_greedy_tokens": {"single": same, "concurrent": True}, **extra}
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int4"}
    acc = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 15, "acceptance_rate": 0.5,
           "mean_acceptance_length": 2.5}
    peer = {"gguf": "m.BF16.gguf", "seconds": 1.0, "output_tokens": 50, "llama_cpp_version": "0.3.36",
            "same_tokens_as_pagedllm": 1}
    data = {"meta": {"command": "pagedllm bench spec --compare llama.cpp", "commit": "abc1234", "time": "t"},
            "model": "default", "dtype": "auto", "max_tokens": 128, "num_prompts": 4, "concurrency": 0,
            "workload": "chat",
            "runs": [run(None, 100.0), run(draft, 150.0, False, acceptance=acc, draft={"passes": 9, "seconds": 0.045,
                                                                                      "ms_per_pass": 5.0})],
            "llamacpp": [dict(peer, draft=None, output_tok_s=50.0),
                         dict(peer, draft={"method": "prompt_lookup", "max_ngram_size": 2, "num_pred_tokens": 2},
                              output_tok_s=60.0)]}
    text = _render(tmp_path, "amx_spec_chat.json", data)
    assert "## Speculative decoding" in text and "### `amx_spec_chat.json`: chat questions" in text
    assert f"| `{json.dumps(draft)}` | 150.0 | 1.50x | 50.0% | 2.50 | 5.00 | NO |" in text
    assert "| off | 100.0 | 1.00x | - | - | - | yes |" in text
    assert "| off | 50.0 | 1.00x | 2.00x | 3.00x | 1 of 4 |" in text
    assert '"prompt_lookup", "max_ngram_size": 2, "num_pred_tokens": 2}` | 60.0 | 1.20x | 1.67x | 2.50x |' in text


def test_serve_section_shows_the_server_over_offline_ratio(tmp_path):
    from pagedllm.benchmarks.serve import offline_ratios

    report = {"benchmark": "serve", "server": "pagedllm", "base_url": "http://127.0.0.1:1", "served_model": "m",
              "workload": {"num_requests": 4, "input_len_range": [32, 512], "output_len_range": [16, 256]},
              "runs": [_serve_run(1.0, 45.0, 400), _serve_run("inf", 96.0, 400)],
              "offline": {"dtype": "bfloat16", "elapsed_s": 4.0, "output_tokens": 400,
                          "output_tokens_per_s": 100.0, "engine_flags": "--max-num-seqs 64"}}
    report["offline_ratio"] = offline_ratios(report)
    assert [r["output_throughput"] for r in report["offline_ratio"]] == [0.45, 0.96]
    text = _render(tmp_path, "serve.json", report)
    assert "100.0 output tok/s" in text and "`--max-num-seqs 64`" in text
    assert "| inf | 0.96 | yes |" in text and "| 1.0 | 0.45 | yes |" in text


def test_serve_section_shows_repeated_rounds_and_their_median(tmp_path):
    from pagedllm.benchmarks.serve import offline_ratios, repeat_summary

    rounds = []
    for tps, off in ((80.0, 100.0), (95.0, 100.0), (60.0, 100.0)):
        report = {"benchmark": "serve", "server": "pagedllm", "base_url": "http://127.0.0.1:1", "served_model": "m",
                  "workload": {"num_requests": 4, "input_len_range": [32, 512], "output_len_range": [16, 256]},
                  "runs": [_serve_run("inf", tps, 400)],
                  "offline": {"dtype": "bfloat16", "elapsed_s": 4.0, "output_tokens": 400,
                              "output_tokens_per_s": off, "engine_flags": ""}}
        report["offline_ratio"] = offline_ratios(report)
        rounds.append([report])
    data = {"benchmark": "serve", "repeat": 3, "summary": repeat_summary(rounds),
            "rounds": [{"servers": r, "ratios": []} for r in rounds]}
    text = _render(tmp_path, "serve-offline.json", data)
    assert "## Online serving" in text and "### 3 rounds of `pagedllm`" in text
    assert "| inf | 0.80, 0.95, 0.60 | **0.80** |" in text
    assert "Server / offline output tok/s per round (last rate): 80.0 / 100.0, 95.0 / 100.0, 60.0 / 100.0." in text


def test_lora_section_shows_each_phase_against_the_base_model(tmp_path):
    """A `bench lora` result: the three phases with their ratio to the base model, the load costs."""
    phase = {"seconds": 2.0, "output_tokens": 2000}
    data = {"benchmark": "lora", "model": "default", "num_adapters": 8, "rank": 16, "dtype": "auto",
            "num_prompts": 64, "base": dict(phase, output_tok_s=1000.0), "lora": dict(phase, output_tok_s=800.0),
            "lora_no_adapter_rows": dict(phase, output_tok_s=1010.0), "load_ms": {"check": 16.2, "worker": 21.4},
            "meta": {"command": "pagedllm bench lora --rounds 2", "commit": "abc1234", "time": "2026-12-07"}}
    text = _render(tmp_path, "amx_lora.json", data)
    assert "### `amx_lora.json`: 64 requests, default (auto), 8 adapters of rank 16" in text
    assert "| 8 adapters of rank 16 on every linear layer, mixed | 800.0 | 0.80x |" in text
    assert "| LoRA on, no adapter rows | 1010.0 | 1.01x |" in text
    assert "the front end's check 16 ms, the worker's read and layout 21 ms" in text
    assert "pagedllm bench lora --rounds 2" in text
    assert "vLLM" not in text.split("### `amx_lora.json`")[1]
    assert "Run with prefix caching on" in text  # a result from before the benchmark turned it off
    (tmp_path / "no-prefix").mkdir()
    text = _render(tmp_path / "no-prefix", "amx_lora.json", dict(data, prefix_caching=False))
    assert "Run with prefix caching on" not in text.split("### `amx_lora.json`")[1]


def test_lora_section_shows_vllm_with_the_same_adapters(tmp_path):
    """`bench lora --compare vllm`: vLLM's rows (with the adapters, LoRA off) beside the phases, and
    pagedllm's ratio to vLLM with the adapters."""
    phase = {"seconds": 2.0, "output_tokens": 2000}
    data = {"benchmark": "lora", "model": "default", "num_adapters": 8, "rank": 16, "dtype": "auto",
            "num_prompts": 64, "base": dict(phase, output_tok_s=1000.0), "lora": dict(phase, output_tok_s=800.0),
            "lora_no_adapter_rows": dict(phase, output_tok_s=1010.0),
            "vllm": dict(phase, output_tok_s=320.0, version="0.32.0", dtype="bfloat16"), "ratio_vs_vllm": 2.5,
            "vllm_base": dict(phase, output_tok_s=640.0, version="0.32.0", dtype="bfloat16"),
            "meta": {"command": "pagedllm bench lora --compare vllm", "commit": "abc1234", "time": "2026-12-07"}}
    text = _render(tmp_path, "amx_lora_vllm.json", data)
    assert "| vLLM 0.32.0 (bfloat16): the same adapters, mixed the same way | 320.0 | 0.32x |" in text
    assert "| vLLM 0.32.0 (bfloat16): LoRA off | 640.0 | 0.64x |" in text
    assert ("pagedllm with the adapters: **2.50x** vLLM's CPU build with the same adapters. vLLM with the adapters "
            "ran at 0.50x its own rate without LoRA.") in text
    data["vllm"] = {"error": "vLLM's CPU build is not installed: no bin/python in /x"}
    (tmp_path / "no-vllm").mkdir()
    text = _render(tmp_path / "no-vllm", "amx_lora_vllm.json", data)
    assert "vLLM with the same adapters did not run: vLLM's CPU build is not installed" in text


def _scheduler_run(commit: str) -> dict:
    """A `bench scheduler` result: one row, a run record naming `commit` and an Intel Xeon."""
    row = {"num_running": 256, "num_waiting": 2000, "schedule_us": 4000.0, "update_us": 1700.0,
           "step_us_mean": 5767.0, "step_us_median": 5600.0, "step_us_p99": 6346.0, "us_per_request": 22.5}
    meta = {"time": "2026-12-07 07:00:00 UTC", "cpu_model": "Intel(R) Xeon(R) Processor", "cpu_cores": 2,
            "command": "pagedllm bench scheduler --num-running 256 --num-waiting 2000", "commit": commit}
    return {"benchmark": "scheduler", "meta": meta, "results": [row]}


def test_scheduler_section_comes_from_the_amx_run_where_no_unprefixed_one_exists(tmp_path):
    """With amx_scheduler.json and no scheduler.json the page's scheduler section is the AMX host's
    run, and the page does not list scheduler.json as not yet measured."""
    text = _render(tmp_path, "amx_scheduler.json", _scheduler_run("0123456789ab"))
    section = text.split("## Scheduler overhead")[1].split("\n## ")[0]
    assert "Intel(R) Xeon(R) Processor" in section and "| 256 | 2000 | 4000 | 1700 | 5767 | 5600 | 6346 | 22.5 |" in section
    assert "scheduler.json" not in text.split("## Not yet measured")[1]


def test_report_reads_no_result_file_under_history(tmp_path):
    """benchmarks/results/history/ keeps runs the page no longer shows: a result file there feeds no
    section and no row of the runs table, where the same file in the folder itself does."""
    results = tmp_path / "results"
    (results / "history").mkdir(parents=True)
    (results / "history" / "scheduler.json").write_text(json.dumps(_scheduler_run("fedcba987654+dirty")))
    (results / "amx_scheduler.json").write_text(json.dumps(_scheduler_run("0123456789ab")))
    doc = tmp_path / "benchmarks.md"
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "report", "--results", str(results), "--doc", str(doc), "--no-plots"]) == 0
    text = doc.read_text()
    assert "fedcba987654" not in text and "no (+dirty)" not in text
    assert "| `amx_scheduler.json` | 0123456 |" in text


def test_no_committed_result_comes_from_a_dirty_tree():
    """Every run record of benchmarks/results (not history/) names a clean commit: a run from a tree
    with uncommitted changes moves to history/ with its figures quoted in docs/perf-history.md, and
    the page's runs table shows no "no (+dirty)" row."""
    from pagedllm.benchmarks.report import RESULTS
    from pagedllm.benchmarks.report_extra import _metas
    from pagedllm.benchmarks.report_render import load

    dirty = sorted({p.name for p in RESULTS.glob("*.json") if (data := load(p)) is not None
                    for m in _metas(data) if str(m.get("commit", "")).endswith("+dirty")})
    assert dirty == [], f"runs from trees with uncommitted changes: {dirty}"
    assert "no (+dirty)" not in (ROOT / "docs" / "benchmarks.md").read_text()
