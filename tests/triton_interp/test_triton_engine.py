"""The engine on the Triton attention path (what runs on a GPU), on the CPU under Triton's
interpreter: the same greedy tokens and logprobs as the torch backend through chunked prefill
mixed with decodes, prefix-cache hits and n > 1."""

from __future__ import annotations

import os

import pytest

from pagedllm import LLM, SamplingParams

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

pytestmark = pytest.mark.triton_interp

SHARED = "Paged attention stores the key value cache in fixed size blocks. "
PROMPTS = [
    SHARED + "Continuous batching schedules tokens, not phases, at every step. Once upon a time",
    "Hello world!",
    SHARED + "The quick brown fox",
    "What is the capital of France?",
]


def generate(model_dir: str, backend: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=24, num_kv_blocks=48, seed=0)
    runner = llm.llm_engine.executor.runner
    assert runner.triton_attention == (backend == "triton")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=7, n=2, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    outs += llm.generate(PROMPTS[2:], greedy, use_tqdm=False)  # the shared prefix is cached now
    outs += llm.generate(PROMPTS[1:2], sampled, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def test_engine_on_triton_attention_matches_the_torch_backend(tiny_model_dir, monkeypatch) -> None:
    ours = generate(tiny_model_dir, "triton", monkeypatch)
    ref = generate(tiny_model_dir, "torch", monkeypatch)
    assert [[t for t, _ in o] for o in ours] == [[t for t, _ in o] for o in ref]
    for o, r in zip(ours, ref):
        for (_, lo), (_, lr) in zip(o, r):
            for dl, dr in zip(lo or [], lr or []):
                assert dl.keys() == dr.keys()
                for tok in dl:
                    assert dl[tok].logprob == pytest.approx(dr[tok].logprob, abs=1e-4)
