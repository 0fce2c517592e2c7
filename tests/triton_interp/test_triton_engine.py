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


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replaying re-runs the captured forward
    pass on the static buffers, which is what a graph replay computes."""

    def __init__(self, graphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size] = self.graphs._forward(self.size)


@pytest.mark.slow
def test_decode_steps_through_padded_static_buffers_match_eager(tiny_model_dir, monkeypatch) -> None:
    """The CUDA-graph input path (static buffers, padding rows with slot -1 and length 0) gives
    the eager path's tokens: padding writes no KV and disturbs no real row."""
    from pagedllm.worker.cuda_graph import CudaGraphRunner

    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eager = LLM(tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=48, seed=0)
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]

    llm = LLM(tiny_model_dir, dtype="float32", device="cpu", num_kv_blocks=48, seed=0)
    runner = llm.llm_engine.executor.runner
    graphs = CudaGraphRunner(runner.model, (1, 2, 8), max_blocks_per_seq=32, sliding_window=0,
                             num_splits={8: 2}, device=runner.device, context=runner.forward_context)
    graphs.graphs = {b: _EagerReplay(graphs, b) for b in graphs.sizes}
    runner.cuda_graphs = graphs
    replays = []
    original = graphs.run
    graphs.run = lambda batch: replays.append(len(batch.input_ids)) or original(batch)  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert 4 in replays  # four decodes padded to the size-8 buffers


def test_block_sizes_the_kernel_cannot_read_are_refused_at_start(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="block_size=128"):
        LLM(tiny_model_dir, dtype="float32", device="cpu", block_size=128, num_kv_blocks=8)


@pytest.mark.slow
def test_window_groups_on_triton_attention_match_the_torch_backend(tmp_path, monkeypatch) -> None:
    """Gemma 3's KV layer groups (a full group and sliding groups whose blocks before the window
    are freed) read through the Triton kernel's per-group block tables: the torch backend's tokens."""
    from tests.integration.test_gemma3 import random_gemma3, tiny_config

    from pagedllm.models.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer(320)
    random_gemma3(tiny_config(len(tok))).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    prompts = [{"prompt_token_ids": [(7 * i + 3 * n) % 300 + 3 for i in range(n)]} for n in (37, 5, 21)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
        llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=64,
                  block_size=16, max_model_len=128)
        assert llm.llm_engine.scheduler.kv.groups.num_groups == 6
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]
