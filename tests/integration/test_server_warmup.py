"""The engine-core process warms up before the server reports ready (engine/warmup.py), and leaves
no trace: right after start the metrics count nothing, the first requests give what an in-process
`LLM` (which does not warm up) gives on the same prompts, greedy, unseeded random (the default
generator untouched) and seeded, and the prefix cache hits what the in-process engine's hits.
In-process, the warm-up leaves the scheduler, the block pool, the runner's requests and the
default generator as they were.

One server of its own, started for this module: the shared ones have served other modules first.
"""

from __future__ import annotations

import re

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.warmup import warm_up
from server_helpers import Server, serve

FLAGS = ("--dtype", "float32", "--num-kv-blocks", "128", "--max-num-seqs", "16", "--max-num-batched-tokens", "2048")
COUNTERS = ("pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total", "pagedllm:request_success_total",
            "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total")
PROMPTS = [[10 + (7 * i + 13 * k) % 290 for i in range(40 + 9 * k)] for k in range(4)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    with serve(tmp_path_factory.mktemp("warmup-server"), tiny_model_dir, *FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=2048)


def _counters(http) -> dict[str, float]:
    """Each counter summed over its labels."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for name, value in re.findall(r"^(pagedllm:[a-z_]+_total)(?:\{[^}]*\})? (\S+)$", http.get("/metrics").text, re.M):
        if name in out:
            out[name] += float(value)
    return out


def _complete(http, model: str, prompt: list[int], **sampling) -> list[int]:
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                                            "return_token_ids": True, **sampling})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _generate(llm: LLM, prompt: list[int], **sampling) -> list[int]:
    params = SamplingParams(max_tokens=12, ignore_eos=True, **sampling)
    return list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_warm_up_logged_and_metrics_zero(server: Server, http):
    # The engine core logs the warm-up before it reports ready.
    assert re.search(r"warm-up: \d+ ms", server.output()), server.output()[-3000:]
    assert _counters(http) == dict.fromkeys(COUNTERS, 0.0)


def test_first_requests_match_in_process_engine(http, model: str, llm: LLM):
    # In order, on both: the first request greedy, then an unseeded random one (it draws from the
    # default generator, seeded at start-up: equal only if the warm-up drew nothing from it), then
    # a seeded one.
    runs = [({"temperature": 0.0}, PROMPTS[0]), ({"temperature": 1.0}, PROMPTS[1]),
            ({"temperature": 0.9, "top_p": 0.9, "seed": 11}, PROMPTS[2])]
    for sampling, prompt in runs:
        assert _complete(http, model, prompt, **sampling) == _generate(llm, prompt, **sampling), sampling


def test_prefix_cache_hits_match_in_process_engine(http, model: str, llm: LLM):
    before = _counters(http)
    stats = llm.llm_engine.core.scheduler.get_stats()
    for _ in range(2):
        _complete(http, model, PROMPTS[3], temperature=0.0)
        _generate(llm, PROMPTS[3], temperature=0.0)
    after = _counters(http)
    now = llm.llm_engine.core.scheduler.get_stats()
    hits = after["pagedllm:prefix_cache_hits_total"] - before["pagedllm:prefix_cache_hits_total"]
    queries = after["pagedllm:prefix_cache_queries_total"] - before["pagedllm:prefix_cache_queries_total"]
    assert hits == now.prefix_cache_hits - stats.prefix_cache_hits > 0
    assert queries == now.prefix_cache_queries - stats.prefix_cache_queries
    assert after["pagedllm:request_success_total"] == 5


def test_warm_up_leaves_the_engine_as_it_was(tiny_model_dir: str):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128)
    core = llm.llm_engine.core
    pool, runner = core.scheduler.kv.pool, core.executor.runner

    def state():
        return (list(pool._free), dict(pool._cached), [b.ref_cnt for b in pool.blocks], core.scheduler.get_stats(),
                dict(runner.input_batch.req_index), dict(runner.generators), torch.get_rng_state())

    before = state()
    assert warm_up(core) is not None  # a budget of 128 tokens: its prompt of 256 in two chunks of 128
    after = state()
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after))


def test_no_warm_up_where_the_first_batch_sets_the_fp8_kv_scales(tiny_model_dir: str):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    core = llm.llm_engine.core
    assert warm_up(core) is None
    scales = [(m.k_scale, m.v_scale) for m in core.executor.runner.model.modules() if hasattr(m, "calculate_kv_scales")]
    assert scales and all(s == (1.0, 1.0) for s in scales)  # still to be set by the first request
