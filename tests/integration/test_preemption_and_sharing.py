"""Block sharing and preemption on the real default model: greedy outputs do not depend on the
prefix cache, on swap or recompute preemption or on a prefix-cache reset mid-run; the n samples
of a request share the prompt's blocks (copy-on-write) and are reproducible under a seed."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

SYSTEM = (
    "You are a helpful assistant for a small bakery. You answer questions about bread, cakes, opening "
    "hours and prices politely and briefly. "
)
QUESTIONS = [
    "What time do you open on Sunday?",
    "Do you sell gluten-free bread?",
    "How much is a croissant?",
    "Can I order a birthday cake?",
    "Where is the shop?",
    "Do you have vegan cakes?",
]
# Six prompts behind one system prompt (prefix-cache hits) and two unrelated ones.
PROMPTS = [SYSTEM + q for q in QUESTIONS] + [
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# 12 blocks of 16 tokens hold about two of the ~56-token requests at once: preemption is certain.
TIGHT = {"dtype": "float32", "num_kv_blocks": 12, "block_size": 16, "max_model_len": 256}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def roomy() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=128, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def reference(roomy: LLM) -> list[list[int]]:
    outs = roomy.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = roomy.llm_engine.scheduler.get_stats()
    assert stats.num_preemptions == 0 and stats.prefix_cache_hits > 0
    return [o.outputs[0].token_ids for o in outs]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_greedy_same_without_prefix_caching(reference: list[list[int]]) -> None:
    llm = LLM(dtype="float32", num_kv_blocks=128, block_size=16, max_model_len=256, enable_prefix_caching=False)
    assert tokens(llm) == reference
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries == 0 and stats.num_preemptions == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_same_under_forced_preemption(reference: list[list[int]], mode: str) -> None:
    llm = LLM(preemption_mode=mode, swap_space=0.05, **TIGHT)
    assert tokens(llm) == reference
    stats = llm.llm_engine.scheduler.get_stats()
    other = "swap" if mode == "recompute" else "recompute"
    assert stats.num_preemptions_by_mode[mode] > 0 and stats.num_preemptions_by_mode[other] == 0, stats
    assert stats.num_swapped == 0 and stats.kv_cache_usage == 0 and stats.swap_usage == 0
    if mode == "swap":
        assert llm.llm_engine.executor.runner.num_swap_blocks == llm.llm_engine.scheduler.kv.num_swap_blocks > 0


def test_greedy_same_after_prefix_cache_reset_mid_run(roomy: LLM, reference: list[list[int]]) -> None:
    engine = roomy.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"reset-{i}", prompt, GREEDY)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            engine.reset_prefix_cache()  # requests are mid-decode: they keep their blocks
            first_key = engine.scheduler.requests["reset-0"].block_hashes[0]
            assert engine.scheduler.kv.pool.get_cached_block(first_key) is None
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_integrity()
        steps += 1
    assert [finished[f"reset-{i}"] for i in range(len(PROMPTS))] == reference
    # Blocks keyed before the reset stay unkeyed; the next request computes and keys them again.
    (first,) = roomy.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    (second,) = roomy.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference[0]


def test_n_samples_share_prompt_blocks_copy_on_write(roomy: LLM) -> None:
    engine = roomy.llm_engine
    kv = engine.scheduler.kv
    prompt = roomy.get_tokenizer().encode(
        "Write one sentence about the colour of the sea at dawn, when the fishing boats leave the harbour:"
    )
    assert len(prompt) % 16 != 0 and len(prompt) > 16  # a partly filled last block
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    copies_before = kv.num_cow_copies
    engine.add_request("cow", prompt, params)
    ids = [f"{i}_cow" for i in range(4)]
    engine.step()  # sample 0 computes the prompt; the other three fork off it
    tables = [kv.get_block_ids(r) for r in ids]
    n_blocks = -(-len(prompt) // 16)
    assert all(t == tables[0] for t in tables) and len(tables[0]) == n_blocks
    assert [kv.pool.blocks[b].ref_cnt for b in tables[0]] == [4] * n_blocks
    engine.step()  # first decode step: each sample writes into the shared partly filled block
    tables = [kv.get_block_ids(r) for r in ids]
    full = tables[0][:-1]
    assert all(t[:-1] == full for t in tables)  # full prompt blocks stay shared ...
    assert [kv.pool.blocks[b].ref_cnt for b in full] == [4] * len(full)
    assert len({t[-1] for t in tables}) == 4  # ... the partly filled one was copied three times
    assert kv.num_cow_copies - copies_before == 3
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = [o for o in outs if o.request_id == "cow"]
    texts = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in texts}) == 4  # the samples differ from each other

    # With the request's seed, each sample is the same from run to run, whatever else is batched.
    (alone,) = roomy.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    mixed = roomy.generate(
        [PROMPTS[0], {"prompt_token_ids": prompt}, PROMPTS[6]],
        [SamplingParams(temperature=0.9, max_tokens=5), params, GREEDY],
        use_tqdm=False,
    )
    assert [c.token_ids for c in alone.outputs] == texts
    assert [c.token_ids for c in mixed[1].outputs] == texts


def test_n_samples_with_prompt_logprobs_report_the_prompt_once(roomy: LLM) -> None:
    prompt = SYSTEM + QUESTIONS[0]  # cached by other requests: prompt logprobs bypass the cache
    # ignore_eos: without a chat template the model's first token is EOS with probability 0.49 here.
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    (out,) = roomy.generate(prompt, params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert all(d is not None and t in d for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 3 for c in out.outputs)
