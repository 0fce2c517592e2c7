"""pagedllm/benchmarks/gpu_check.py (`make gpu-check`, `pagedllm bench gpu-check`) runs as written where
there is no GPU: the dry run (arguments, meta-device shapes, the JSON) and a CPU smoke run of its whole
path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def gpu_check():
    from pagedllm.benchmarks import gpu_check

    return gpu_check


def test_dry_run_writes_the_plan_with_meta_device_shapes(gpu_check, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--batch-sizes", "64,1,8"]) == 0
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["schema_version"] == gpu_check.SCHEMA_VERSION
    assert result["settings"]["batch_sizes"] == [1, 8, 64]
    # Llama 3.1 8B and Llama 3.2 1B parameter counts, from models built on the meta device.
    assert result["shapes"]["llama-8b"]["parameters"] == 8_030_261_248
    assert result["shapes"]["llama-1b"]["parameters"] == 1_235_814_400
    assert result["shapes"]["llama-8b"]["kv_bytes_per_token_bf16"] == 131072
    assert result["models"] == {"llama-8b": None, "llama-1b": None}
    assert result["peaks"] is None and result["gpu_tests"] is None and result["measured"] == {}
    assert result["targets"]["decode_hbm_fraction_8b_batch64"] == 0.70


def test_bad_arguments_exit_with_a_message(gpu_check, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--models", "llama-70b"])
    assert "llama-70b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--prefill", "8"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--batch-sizes", "0,4"])


def test_agreement_counts_exact_and_close_sequences(gpu_check) -> None:
    ref = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    ref_tops = [[{1, 9}, {2, 8}, {3, 7}]] * 3
    ours = [[1, 2, 3], [1, 8, 3], [5, 2, 3]]
    our_tops = [[{1}, {2}, {3}], [{1}, {8, 2}, {3}], [{5}, {2}, {3}]]
    a = gpu_check.agreement(ours, our_tops, ref, ref_tops)
    assert a["exact_fraction"] == pytest.approx(1 / 3)
    assert a["close_fraction"] == pytest.approx(2 / 3)  # 8 is in the reference's top 5 and 2 in ours
    assert a["mean_matched_prefix_fraction"] == pytest.approx((1 + 1 / 3 + 0) / 3)


def test_cpu_smoke_run_of_the_whole_benchmark_path(gpu_check, tmp_path: Path, one_torch_thread) -> None:
    out = tmp_path / "smoke.json"
    argv = ["--device", "cpu", "--models", "tiny", "--batch-sizes", "1,2", "--prompt-len", "8",
            "--decode-steps", "2", "--prefill", "2,16", "--skip-tests", "--skip-default-model", "--skip-lora", "--out", str(out)]
    assert gpu_check.main(argv) == 0
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert [d["batch"] for d in tiny["decode"]] == [1, 2]
    assert all(d["tok_per_s"] > 0 and d["hbm_fraction"] > 0 for d in tiny["decode"])
    assert tiny["eager_batch1"]["batch"] == 1 and tiny["cuda_graph_speedup_batch1"] > 0
    assert tiny["prefill"]["prompts"] == 2 and tiny["prefill"]["mfu_fraction"] > 0
    report = gpu_check.markdown_report(json.loads(out.read_text()))
    assert "| tiny | 2 |" in report and "| tiny | 2 x 16 |" in report
