"""Speculative decoding in bfloat16 on a CPU with AMX: greedy outputs are the same token for token
as without speculation, for n-gram, suffix and an int4 self-draft, and with a LoRA adapter. There a
bf16 GEMM of one row runs in the AVX-512 BF16 form and from two rows on AMX tiles, which sum in
another order; a speculating engine runs a step of one request's last token and its proposals in the
AVX-512 form (worker/spec_decode.alone_rows, layers/native_linear.amx_rows_from), so that each of
its rows gives the bits it gives alone; each token of a verification attends alone, as a decode
(worker/spec_decode.verifies_only), on the torch path a LoRA engine takes as in the fused decode
step. LoRA deltas on the tiles give a row the same bits alone as in a batch
(tests/unit/test_lora_kernel.py). The chat questions and lengths are those on which the
two forms parted (at the 30th to 68th token) before."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.benchmarks.lora import write_random_adapter
from pagedllm.benchmarks.spec import CHAT
from pagedllm.layers.native_linear import amx_rows, kernel_dtypes
from pagedllm.models.loader import load_hf_config, resolve_model

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not amx_rows() or torch.bfloat16 not in kernel_dtypes(),
                       reason="no AMX-BF16 on this CPU (or the OS does not lend the tiles): bf16 rows give the "
                              "same bits alone as in a batch (tests/unit/test_native_linear.py)"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=128)
BASE = {"dtype": "bfloat16", "max_model_len": 512, "kv_cache_memory": "256MiB"}
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix"},
    "int4 self-draft": {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int4"},
}


def answers(llm: LLM, lora: LoRARequest | None = None) -> list[list[int]]:
    """Each of the first four chat questions alone (a single stream: steps of one row without
    proposals)."""
    return [list(llm.chat([[{"role": "user", "content": q}]], GREEDY, use_tqdm=False, lora_request=lora)[0]
                 .outputs[0].token_ids) for q in CHAT[:4]]


def same(got: list[list[int]], reference: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(got, reference)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"question {i}: parts from speculation off at token {first} of {len(b)}"


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(**BASE)
    try:
        return answers(llm)
    finally:
        del llm


# n-gram here (and with a LoRA adapter below); suffix and the int4 self-draft, whose proposals the
# same verification checks, run in the slow suite.
@pytest.mark.parametrize("name", [n if n == "ngram" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS])
def test_bf16_greedy_same_with_speculation(name: str, reference: list[list[int]]) -> None:
    llm = LLM(**BASE, speculative_config=CONFIGS[name])
    got = answers(llm)
    stats = llm.llm_engine.scheduler.get_stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats  # it did speculate
    same(got, reference)


def test_bf16_greedy_same_with_speculation_and_lora(tmp_path) -> None:
    """n-gram proposals verified with a rank-16 adapter on every linear layer (bf16 adapter, deltas
    on the tiles) give the adapter's tokens without speculation."""
    config = load_hf_config(resolve_model(None))
    lora = LoRARequest("a", 1, write_random_adapter(config, tmp_path / "a", 16, 3, b_std=0.05))
    off = LLM(**BASE, enable_lora=True, max_lora_rank=16, lora_dtype="bfloat16")
    try:
        reference = answers(off, lora)
    finally:
        del off
    llm = LLM(**BASE, enable_lora=True, max_lora_rank=16, lora_dtype="bfloat16", speculative_config=CONFIGS["ngram"])
    got = answers(llm, lora)
    stats = llm.llm_engine.scheduler.get_stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    same(got, reference)
