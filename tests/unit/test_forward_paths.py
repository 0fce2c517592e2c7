"""The model runner's forward paths: which one select_path picks for a step, their fallbacks when
the native call declines a step, the pipeline's micro-batches, and the KV cache's block moves."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.forward import ForwardPaths, micro_batches
from pagedllm.worker.native_decode import load_decode_kernel

PROMPTS = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (3, 17, 9)]


def test_micro_batches_cut_at_about_equal_tokens() -> None:
    assert micro_batches([4, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert micro_batches([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert micro_batches([5], 4) == [(0, 1)]
    assert micro_batches([2, 2, 2], 1) == [(0, 3)]


def test_a_pipeline_rank_takes_the_pipeline_path_for_every_step() -> None:
    eager, pipeline = object(), object()
    paths = ForwardPaths(eager, pipeline=pipeline)  # type: ignore[arg-type]
    assert paths.select_path(None) is pipeline  # type: ignore[arg-type]
    assert ForwardPaths(eager).select_path(None) is eager  # type: ignore[arg-type, call-arg]


def test_lora_steps_replay_only_graphs_captured_with_the_lora_kernels() -> None:
    from types import SimpleNamespace

    from pagedllm.worker.forward.base import PreparedStep

    eager = object()
    step, lora_step = PreparedStep(None, [], None, None, None), PreparedStep(None, [], None, None, None, lora=True)
    for captured_lora in (True, False):
        graph = SimpleNamespace(lora=captured_lora)
        paths = ForwardPaths(eager, cuda_graph=graph)  # type: ignore[arg-type]
        assert paths.select_path(step) is graph  # type: ignore[arg-type]
        assert paths.select_path(lora_step) is (graph if captured_lora else eager)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str, one_torch_thread) -> LLM:
    return LLM(model=tiny_model_dir, dtype="float32", num_kv_blocks=256, block_size=16)


def _taken(llm: LLM, params: SamplingParams) -> tuple[list, Counter]:
    """The outputs of PROMPTS and how many steps took each path."""
    paths = llm.llm_engine.core.executor.runner.paths
    taken: Counter = Counter()
    select = paths.select_path

    def recording(step):  # noqa: ANN001, ANN202
        path = select(step)
        taken[path.name] += 1
        return path

    paths.select_path = recording
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        del paths.select_path
    return [o.outputs[0].token_ids for o in outs], taken


needs_native = pytest.mark.skipif(load_decode_kernel() is None, reason="no C compiler for the fused decode step")


@needs_native
def test_prompts_run_eager_and_greedy_decodes_through_the_native_head(llm: LLM) -> None:
    _, taken = _taken(llm, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert taken["eager"] >= 1 and taken["native_head"] >= 5
    assert taken["native_decode"] == 0


@needs_native
def test_prompt_logprobs_keep_the_step_on_the_native_decode_path(llm: LLM) -> None:
    # the prompt logprobs need hidden states: the head path does not take such a request's steps
    _, taken = _taken(llm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1))
    assert taken["native_decode"] >= 3 and taken["native_head"] == 0


@needs_native
def test_steps_the_native_call_declines_run_on_the_fallbacks(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runner = llm.llm_engine.core.executor.runner
    want, _ = _taken(llm, params)
    nd = runner.native_decode
    calls: Counter = Counter()

    def declined(name):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return None
        return run

    nd.run_head = declined("head")  # the head declines: native decode, then the torch LM head
    try:
        got, taken = _taken(llm, params)
        assert got == want and calls["head"] == taken["native_head"] > 0
        nd.run = declined("run")  # and the decoder stack too: the torch forward pass
        got, _ = _taken(llm, params)
        assert got == want and calls["run"] > 0
    finally:
        nd.__dict__.pop("run_head", None)
        nd.__dict__.pop("run", None)


def test_setting_native_decode_rebuilds_the_paths(llm: LLM) -> None:
    runner = llm.llm_engine.core.executor.runner
    nd = runner.native_decode
    try:
        runner.native_decode = None
        assert runner.paths.native is None and runner.paths.native_head is None
        _, taken = _taken(llm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert set(taken) == {"eager"}
    finally:
        runner.native_decode = nd
    assert (runner.paths.native is not None) == (nd is not None)


def test_block_moves_read_every_source_before_writing(llm: LLM) -> None:
    """A swap-out frees device block 1, which a swap-in and a copy write in the same step."""
    kv = llm.llm_engine.core.executor.runner.kv
    if kv.num_swap_blocks < 2:
        kv.allocate_swap(4)
    cache, pool = kv.kv_caches[0], kv.swap_caches[0]
    for b in range(3):
        cache[:, b] = float(b)
        pool[:, b] = 10.0 + b
    kv.move_blocks(swap_out=[(1, 0)], swap_in=[(2, 1)], copy=[(1, 2)])
    assert torch.all(pool[:, 0] == 1.0)   # device block 1 as it was before the step
    assert torch.all(cache[:, 1] == 12.0)  # host block 2
    assert torch.all(cache[:, 2] == 1.0)   # the copy read block 1 before the swap-in wrote it
    assert np.isclose(kv.bytes_per_block(), kv.bytes_per_token() * kv.block_size)
