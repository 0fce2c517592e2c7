"""Perplexity with llama.cpp's convention: the windows, the scored half, the summary, the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.eval.perplexity import perplexity, score_window, summarize, windows_of


def test_windows_drop_the_tail_and_take_bos() -> None:
    w = windows_of(list(range(10, 21)), 4, bos=1, chunks=None)  # 11 tokens -> 2 windows
    assert w == [[1, 11, 12, 13], [1, 15, 16, 17]]
    assert windows_of(list(range(10)), 4, bos=None, chunks=1) == [[0, 1, 2, 3]]


def test_only_the_second_half_is_scored() -> None:
    # ctx 8: first = 4; logits at positions 4..6 predict tokens 5..7
    nll = score_window(list(range(8)), [-float(j) for j in range(7)])
    assert nll == [4.0, 5.0, 6.0]


def test_summary_matches_llamacpp_formula() -> None:
    nlls = [[1.0, 2.0], [3.0, 1.0]]
    r = summarize(nlls, ctx=6, seconds=2.0)
    mean = 7 / 4
    var = (1 + 4 + 9 + 1) / 4 - mean**2
    assert r.ppl == pytest.approx(math.exp(mean))
    assert r.stderr == pytest.approx(math.exp(mean) * math.sqrt(var / 3))
    assert r.tokens_per_s == pytest.approx(6.0) and r.chunk_ppl[0] == pytest.approx(math.exp(1.5))


def test_python_api_and_cli_agree(tiny_model_dir: str, tmp_path: Path, capsys, one_torch_thread) -> None:
    text = tmp_path / "t.txt"
    text.write_text("Hello world! This is a tiny tokenizer for engine tests. " * 40)
    r = perplexity(tiny_model_dir, text, ctx=32, chunks=3, progress=False, dtype="float32")
    assert r.windows == 3 and r.scored_tokens == 3 * 15 and r.ppl > 1
    assert main(["eval", "perplexity", "--model", tiny_model_dir, "--file", str(text), "--ctx", "32",
                 "--chunks", "3", "--dtype", "float32", "--no-progress"]) == 0
    assert f"PPL = {r.ppl:.4f} +/- {r.stderr:.5f}" in capsys.readouterr().out


def test_too_short_a_text_is_one_error(tiny_model_dir: str, tmp_path: Path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("Hello")
    assert main(["eval", "perplexity", "--model", tiny_model_dir, "--file", str(text), "--ctx", "64",
                 "--dtype", "float32", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pagedllm eval: error:") and "fewer than one window" in err[-1]


def test_text_is_tokenized_as_llama_perplexity_does() -> None:
    # special-token text stays text (llama.cpp tokenizes the file with parse_special off), no BOS
    # where the GGUF says add_bos_token: false, and each digit is its own piece (tokenizer.ggml.pre)
    from pagedllm.eval.perplexity import tokenize_text
    from pagedllm.models.loader import resolve_model
    from pagedllm.models.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    ids = tokenize_text(tok, "a <|im_start|>\n   2")
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == "a <|im_start|>\n   2"
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids[-2:])) == "\n   2"
    assert not set(ids) & set(tok.all_special_ids)
