"""Structured output with a reasoning parser, and the thinking budget, in the engine core.

A tiny random Llama whose tokenizer has `<think>` and `</think>` as single tokens, served with
`--reasoning-parser deepseek_r1` (a reply starts inside the thinking): the thinking is neither
masked nor fed to the grammar; `thinking_token_budget` ends it by forcing `</think>`; the structure
then holds for the answer (checked with `re.fullmatch`)."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.models.testing import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def thinker(thinker_model_dir: str) -> tuple[LLM, int]:
    from transformers import AutoTokenizer

    llm = LLM(thinker_model_dir, dtype="float32", reasoning_parser="deepseek_r1", num_kv_blocks=64, max_model_len=256)
    return llm, AutoTokenizer.from_pretrained(thinker_model_dir).convert_tokens_to_ids("</think>")


def test_thinking_budget_forces_the_end_then_the_structure_holds(thinker: tuple[LLM, int]) -> None:
    llm, end = thinker
    for budget in (0, 3, 7):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, thinking_token_budget=budget,
                                structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))
        out = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0]
        ids = out.token_ids
        assert end in ids[: budget + 1], (budget, ids)
        answer = out.text.split("</think>", 1)[1]
        assert re.fullmatch(r"[0-9]{3}", answer), out.text
        assert out.finish_reason == "stop"


def test_the_thinking_is_not_constrained(thinker: tuple[LLM, int]) -> None:
    """Without a budget the random model never closes its thinking: every token is what the
    unconstrained request draws."""
    llm, end = thinker
    free = llm.generate(["Hello world"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert end not in free.token_ids
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))
    constrained = llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0]
    assert constrained.token_ids == free.token_ids and constrained.finish_reason == "length"


def test_thinking_budget_needs_a_reasoning_parser(tiny_model_dir: str) -> None:
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=16, max_model_len=128)
    with pytest.raises(ValueError, match="--reasoning-parser"):
        llm.generate(["x"], SamplingParams(max_tokens=2, thinking_token_budget=4), use_tqdm=False)


def test_thinking_budget_needs_a_single_end_of_thinking_token(tmp_path) -> None:  # noqa: ANN001
    path = make_tiny_checkpoint(str(tmp_path / "m"), arch="llama", seed=1)
    llm = LLM(path, dtype="float32", reasoning_parser="qwen3", num_kv_blocks=16, max_model_len=128)
    with pytest.raises(ValueError, match="no single token for '</think>'"):
        llm.generate(["x"], SamplingParams(max_tokens=2, thinking_token_budget=4), use_tqdm=False)


def test_a_prompt_that_closes_the_thinking_constrains_from_the_first_token(thinker: tuple[LLM, int]) -> None:
    """A template that turns thinking off ends the prompt with <think></think>: the structure holds
    from the reply's first token."""
    llm, _ = thinker
    params = SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{4}"))
    out = llm.generate(["Hello <think> </think>"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[a-c]{4}", out.text), out.text
