"""Half-precision dtypes run end to end (torch attention backend) and agree with float32."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_default_model_in_half_precision_answers(dtype):
    llm = LLM(dtype=dtype, kv_cache_memory=64 << 20, max_model_len=512)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    runner = llm.llm_engine.executor.runner
    assert runner.native_kernel is None  # the C kernel serves float32 only
    assert all(c.dtype == runner.dtype for c in runner.kv_caches)


def test_tiny_model_bfloat16_close_to_float32(tiny_model_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [[5, 9, 17, 33, 61], [100, 7, 3]]
    ref = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=32).generate(prompts, params, use_tqdm=False)
    half = LLM(tiny_model_dir, dtype="bfloat16", num_kv_blocks=32).generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, half):
        # The first generated token agrees within the top-5 of the other precision.
        assert a.outputs[0].token_ids[0] in b.outputs[0].logprobs[0]
        assert b.outputs[0].token_ids[0] in a.outputs[0].logprobs[0]
