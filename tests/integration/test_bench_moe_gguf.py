"""The MoE benchmark's GGUF (`pagedllm bench moe`, written with gguf-py's writer under llama.cpp's
`qwen3moe` names) is the same model as its Hugging Face folder: llama.cpp on the F32 GGUF and
pagedllm on the folder (float32) score the same token windows to the same per-token negative
log-likelihoods (the same perplexity within 0.5 %: only the arithmetic differs)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm.eval.llamacpp import llamacpp_perplexity, llamacpp_unavailable
from pagedllm.eval.perplexity import perplexity_of_windows, summarize

_WHY = llamacpp_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(_WHY is not None, reason=f"llama.cpp peer unavailable: {_WHY}")]
CTX = 64


def test_moe_bench_gguf_scores_like_the_folder(tmp_path) -> None:
    import transformers as t

    from pagedllm import LLM
    from pagedllm.benchmarks.moe import moe_config, write_gguf
    from pagedllm.models.loader import default_hf_folder

    cfg = {**moe_config(2, 32), "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 96, "num_experts": 4, "initializer_range": 0.2}
    torch.manual_seed(0)
    hf = t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**cfg)).float().eval()
    hf.save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the vocabulary the GGUF copies
        shutil.copy(Path(default_hf_folder()) / name, tmp_path / name)
    write_gguf(hf, str(tmp_path / "model.F32.gguf"), "F32")
    rng = random.Random(0)
    windows = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(CTX)] for _ in range(3)]
    theirs = summarize(llamacpp_perplexity(str(tmp_path / "model.F32.gguf"), windows, threads=2)["nlls"],
                       CTX, 1.0).ppl
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=CTX + 1)
    ours = perplexity_of_windows(llm, windows).ppl
    assert abs(ours / theirs - 1) < 0.005, (ours, theirs)
