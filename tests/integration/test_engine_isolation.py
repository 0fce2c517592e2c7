"""Two engines in one process share no per-step state: the forward context, the attention
backend and the RoPE tables belong to each runner/model, so engines stepping at the same time in
two threads produce what each produces alone."""

from __future__ import annotations

import threading

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.testing import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [f"Once upon a time {i} small models" * (1 + i % 3) for i in range(8)]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_two_engines_in_two_threads_match_their_solo_runs(tiny_model_dir: str, tmp_path) -> None:
    other = make_tiny_checkpoint(str(tmp_path / "llama"), arch="llama", seed=5, num_attention_heads=8,
                                 num_key_value_heads=2)
    llms = [LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=32),
            LLM(other, dtype="float32", max_num_batched_tokens=32)]
    solo = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] for llm in llms]
    together: list = [None, None]
    start = threading.Barrier(2)

    def go(i: int) -> None:
        start.wait()
        together[i] = [o.outputs[0].token_ids for o in llms[i].generate(PROMPTS, PARAMS, use_tqdm=False)]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo
    runners = [llm.llm_engine.executor.runner for llm in llms]
    assert runners[0].forward_context is not runners[1].forward_context
