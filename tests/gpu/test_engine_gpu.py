"""The engine end to end on a GPU: device selection, CUDA graphs on and off giving the same greedy
tokens, prefix caching, recompute and swap preemption, n > 1 with seeds, the sampler on the GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.gpu

SHARED = "Paged attention stores the key value cache in fixed size blocks. "
PROMPTS = [SHARED + "Continuous batching schedules tokens, not phases.", "Hello world!", SHARED + "The quick",
           "What is the capital of France?", "Once upon a time there was a small language model", "1 2 3 4 5"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ROOMY = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 16, "max_model_len": 256, "seed": 0}


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str) -> list[list[int]]:
    llm = LLM(tiny_model_dir, enforce_eager=True, **ROOMY)
    assert llm.llm_engine.executor.runner.cuda_graphs is None
    return tokens(llm)


def test_auto_device_is_cuda_with_bf16(tiny_model_dir: str) -> None:
    config = EngineArgs(model=tiny_model_dir).create_engine_config()
    assert config.device_config.device == "cuda" and config.model_config.dtype == "bfloat16"
    assert config.device_config.cuda_graph_sizes[:4] == (1, 2, 4, 8)


def test_kv_cache_sized_from_gpu_memory_utilization(tiny_model_dir: str) -> None:
    from pagedllm.worker.device import activation_reserve_bytes

    mc = EngineArgs(model=tiny_model_dir, max_model_len=256).create_engine_config().model_config
    free, total = torch.cuda.mem_get_info()
    # A utilization that leaves about 1 GiB for the KV cache once what is in use and the
    # activation reserve are taken off.
    util = (total - free + activation_reserve_bytes(mc) + (1 << 30)) / total
    llm = LLM(tiny_model_dir, gpu_memory_utilization=util, enforce_eager=True, max_model_len=256)
    runner = llm.llm_engine.executor.runner
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert runner.kv_caches[0].is_cuda and runner.kv_caches[0].dtype == torch.bfloat16
    assert (1 << 30) * 0.75 < kv_bytes <= (1 << 30)
    del llm, runner
    torch.cuda.empty_cache()


def test_cuda_graphs_give_the_same_greedy_tokens(tiny_model_dir: str, reference: list[list[int]]) -> None:
    llm = LLM(tiny_model_dir, cuda_graph_sizes=[1, 2, 4, 8], **ROOMY)
    graphs = llm.llm_engine.executor.runner.cuda_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.capture_seconds > 0
    assert tokens(llm) == reference
    # One request at a time: batch 1, padded to the captured sizes as others finish.
    assert [tokens(llm, [p])[0] for p in PROMPTS[:3]] == reference[:3]


def test_prefix_cache_hits_on_gpu(tiny_model_dir: str, reference: list[list[int]]) -> None:
    llm = LLM(tiny_model_dir, **ROOMY)
    tokens(llm)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_on_gpu_keeps_greedy_tokens(tiny_model_dir: str, reference: list[list[int]], mode: str) -> None:
    tight = {**ROOMY, "num_kv_blocks": 6}
    llm = LLM(tiny_model_dir, preemption_mode=mode, swap_space=0.01, **tight)
    if mode == "swap":
        assert llm.llm_engine.executor.runner.swap_caches[0].is_pinned()
    assert tokens(llm) == reference
    assert llm.llm_engine.scheduler.get_stats().num_preemptions > 0


def test_n_samples_with_seeds_on_gpu(tiny_model_dir: str) -> None:
    llm = LLM(tiny_model_dir, **ROOMY)
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=50, seed=11, max_tokens=8, ignore_eos=True,
                            logprobs=2)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    second = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(first, second):
        assert len(a.outputs) == 3
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) > 1
        assert all(len(c.logprobs or []) == 8 for c in a.outputs)


def test_sampler_on_gpu_matches_cpu_for_greedy_and_processing() -> None:
    from pagedllm.worker.sample import Sampler, SamplingMetadata, SamplingRow

    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 3.0}),
                        None, [1, 2, 3], [4, 5]) for _ in range(6)]
    out = {}
    for dev in ("cpu", "cuda"):
        md = SamplingMetadata.from_rows(rows, 1000, torch.device(dev))
        out[dev] = Sampler()(logits.to(dev), md).sampled_token_ids.cpu()
    assert torch.equal(out["cpu"], out["cuda"])
