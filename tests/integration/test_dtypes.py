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
    assert runner.native_kernel is not None  # the C kernel serves half precision too
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


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_tiny_model_narrow_kv_cache_close_to_float32(tiny_model_dir, kv_dtype):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [[5, 9, 17, 33, 61, 2, 8, 40], [100, 7, 3]]
    ref_llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=32)
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_dtype=kv_dtype, calculate_kv_scales=True, num_kv_blocks=32)
    out = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.llm_engine.executor.runner
    itemsize = runner.kv_caches[0].element_size()
    assert itemsize == (1 if kv_dtype.startswith("fp8") else 2)
    # Capacity in tokens per byte scales with the element size.
    per_token = llm.llm_engine.model_config.kv_bytes_per_token()
    assert per_token * 4 == ref_llm.llm_engine.model_config.kv_bytes_per_token() * itemsize
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids[0] in b.outputs[0].logprobs[0]
        assert b.outputs[0].token_ids[0] in a.outputs[0].logprobs[0]


def test_unknown_kv_cache_dtype_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="fp4"):
        LLM(tiny_model_dir, kv_cache_dtype="fp4")


def test_fp8_kv_cache_survives_swap_preemption(tiny_model_dir):
    # fp8 blocks move to the host pool and back as bytes: the output equals a run without preemption.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 9, 17, 33, 61, 2, 8, 40] * 4 for i in range(8)]
    common = dict(dtype="float32", kv_cache_dtype="fp8_e4m3", block_size=4)
    roomy = LLM(tiny_model_dir, num_kv_blocks=200, **common).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, num_kv_blocks=40, preemption_mode="swap", swap_space=0.01, **common)
    tight = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
