"""`pagedllm bench embed` end to end on all-MiniLM-L6-v2 (a few texts): pagedllm against
sentence-transformers in one report; vLLM's row says why where its environment is missing; bad
flags exit non-zero with one line."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pagedllm.benchmarks.embed import main
from pagedllm.models.loader.pooling import MINILM_PIP

pytestmark = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                reason=f"needs all-MiniLM-L6-v2: {MINILM_PIP}")


def test_embed_reports_ratio_and_a_missing_vllm(tmp_path, capsys) -> None:
    out = tmp_path / "embed.json"
    main(["--num-texts", "12", "--batch-size", "4", "--peers-venv", str(tmp_path / "no-venv"),
          "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["ratio"] > 0 and report["min_cosine"] > 0.9999  # float32 against sentence-transformers
    assert report["vllm"]["ok"] is False and "vLLM's CPU build is not installed" in report["vllm"]["reason"]
    text = capsys.readouterr().out
    assert "sentence-transformers" in text and "vLLM: skipped:" in text


def test_embed_without_vllm_has_no_vllm_row(tmp_path) -> None:
    out = tmp_path / "embed.json"
    main(["--num-texts", "4", "--batch-size", "4", "--no-vllm", "--output-json", str(out)])
    assert "vllm" not in json.loads(out.read_text())


@pytest.mark.parametrize("flag,value", [("--vllm-gpu-memory-utilization", "0"), ("--vllm-kv-cache-space", "0")])
def test_bad_vllm_flags_exit_nonzero(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([flag, value])
    assert e.value.code != 0 and flag in capsys.readouterr().err
