"""Speculative decoding (n-gram) on the real default model and a tiny random one: greedy outputs are
the same token for token as without it (several k, chunked prefill, prefix caching, preemption by
recompute and swap), stop strings, stop tokens and max_tokens end a request exactly where they do
without it, logprobs are those of the kept tokens, the KV pool is whole again afterwards, and a
request with structured output decodes without speculation."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return"
)
QUOTE = (
    "Summarise with quotes. Text: 'The committee met on Monday and agreed to build the new bridge "
    "before winter.' Summary: The committee met on Monday and"
)
SYSTEM = (
    "You are a helpful assistant for a small bakery. You answer questions about bread, cakes, opening "
    "hours and prices politely and briefly. "
)
PROMPTS = [CODE, QUOTE, SYSTEM + "What time do you open?", SYSTEM + "Do you sell bread?", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ROOMY = {"dtype": "float32", "num_kv_blocks": 128, "block_size": 16, "max_model_len": 256}
# 12 blocks of 16 tokens hold about two of these requests at once: preemption is certain.
TIGHT = {"dtype": "float32", "num_kv_blocks": 12, "block_size": 16, "max_model_len": 256, "max_num_seqs": 4}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def spec(k: int, **extra: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **extra}


def tokens(llm: LLM, prompts: list[str] = PROMPTS, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same_logprobs(got: list, want: list) -> None:
    """The same tokens at each position, their logprobs within 1e-4 (the same model and dtype; the
    verified rows' LM head and the decode step's may sum in a different order)."""
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def check_pool_whole(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.kv.req_blocks


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**ROOMY)


@pytest.fixture(scope="module")
def reference(plain: LLM) -> list[list[int]]:
    return tokens(plain)


@pytest.fixture(scope="module")
def speculating() -> LLM:
    return LLM(**ROOMY, speculative_config=spec(4, prompt_lookup_max=3))


def test_greedy_same_with_speculation(speculating: LLM, reference: list[list[int]]) -> None:
    assert tokens(speculating) == reference
    stats = speculating.llm_engine.scheduler.get_stats()
    s = stats.spec_decode
    assert s.num_drafts > 10 and s.num_accepted_tokens > 10, s
    assert stats.prefix_cache_hits > 0  # the two bakery prompts share their system prompt
    check_pool_whole(speculating)


# k=7 in the slow suite: k=1 here and k=4 above cover proposals of one and of several tokens.
@pytest.mark.parametrize("k", [1, pytest.param(7, marks=pytest.mark.slow)])
def test_greedy_same_for_other_k_with_chunked_prefill(k: int, reference: list[list[int]]) -> None:
    # A 24-token budget: prompt chunks share steps with the verifications of running requests.
    llm = LLM(**ROOMY, max_num_batched_tokens=24, speculative_config=spec(k, prompt_lookup_min=2))
    assert tokens(llm) == reference
    assert llm.llm_engine.scheduler.get_stats().spec_decode.num_accepted_tokens > 0
    check_pool_whole(llm)


# Swap in the slow suite: tests/integration/test_preemption_and_sharing.py covers swapping itself.
@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_greedy_same_under_preemption(mode: str, reference: list[list[int]]) -> None:
    llm = LLM(**TIGHT, preemption_mode=mode, swap_space=0.05, enable_prefix_caching=False,
              speculative_config=spec(4))
    assert tokens(llm) == reference
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats.num_preemptions_by_mode[mode] > 0 and stats.spec_decode.num_accepted_tokens > 0, stats
    check_pool_whole(llm)


def test_tiny_random_model_same_with_speculation(tiny_model_dir: str) -> None:
    prompts = ["a b c d a b c d a b", "x y z x y z x", "hello hello hello"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = {"model": tiny_model_dir, "dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_model_len": 128}
    want = tokens(LLM(**base), prompts, params)
    for k in (2, 5):
        llm = LLM(**base, speculative_config=spec(k))
        assert tokens(llm, prompts, params) == want
        assert llm.llm_engine.scheduler.get_stats().spec_decode.num_drafts > 0
        check_pool_whole(llm)


def test_stops_and_lengths_exact(plain: LLM, speculating: LLM) -> None:
    """Stop strings, stop tokens and max_tokens inside a step's accepted tokens: the request ends
    where it ends without speculation, with nothing after it (text, tokens, logprobs)."""
    ref = tokens(plain, [CODE], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    text = plain.get_tokenizer().decode(ref)
    stop_str = text[len(text) // 2 : len(text) // 2 + 4].strip() or "width"
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str], logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref[20]], logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str], include_stop_str_in_output=True),
    ]
    for params in cases:
        want = plain.generate([CODE], params, use_tqdm=False)[0].outputs[0]
        got = speculating.generate([CODE], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason), params
        if params.logprobs is not None:
            assert len(got.logprobs) == len(got.token_ids)
            assert_same_logprobs(got.logprobs, want.logprobs)
    check_pool_whole(speculating)


def test_seeded_sampling_and_n(speculating: LLM) -> None:
    """A seeded sampled request repeats itself with speculation on; n > 1 samples each get their
    tokens (the forked samples speculate too)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=11, ignore_eos=True, n=3)
    a = speculating.generate([CODE], params, use_tqdm=False)[0].outputs
    b = speculating.generate([CODE], params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a) and len({tuple(o.token_ids) for o in a}) > 1
    check_pool_whole(speculating)


def test_structured_request_decodes_without_speculation(speculating: LLM) -> None:
    from pagedllm.sampling_params import StructuredOutputsParams

    before = speculating.llm_engine.scheduler.get_stats().spec_decode.num_drafts
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes yes yes", "no no no"]))
    out = speculating.generate(["Answer yes or no: is the sky blue?"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes yes yes", "no no no")
    assert speculating.llm_engine.scheduler.get_stats().spec_decode.num_drafts == before


def test_verification_on_the_fused_head(plain: LLM, speculating: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone request's verification steps end in the fused decode step's LM head (argmax for
    plain greedy, logits for logprobs and min_tokens), with the same tokens as without speculation."""
    from pagedllm.worker.forward import NativeHeadPath

    runs = {"verify": 0}
    real = NativeHeadPath.run

    def counting(self: NativeHeadPath, step):  # noqa: ANN001, ANN202
        runs["verify"] += step.token_rows is not None
        return real(self, step)

    monkeypatch.setattr(NativeHeadPath, "run", counting)
    ref = tokens(plain, [CODE], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
        # stop_token_ids are blocked until min_tokens: the boundary falls inside a verification
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ref[3]], min_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
    ]
    for params in cases:
        runs["verify"] = 0
        want = plain.generate([CODE], params, use_tqdm=False)[0].outputs[0]
        got = speculating.generate([CODE], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), params
        assert runs["verify"] > 0, params
        if params.logprobs is not None:
            assert_same_logprobs(got.logprobs, want.logprobs)
    check_pool_whole(speculating)


def test_adaptive_speculation_greedy_same_and_off_for_large_batches(tiny_model_dir: str) -> None:
    """Adaptation on (always): greedy tokens as without speculation; with more running requests
    than a CPU step's rows for proposals (core/spec_adaptive.py), no request proposes; with a few,
    they do."""
    from pagedllm.core.spec_adaptive import CPU_ROWS

    base = {"model": tiny_model_dir, "dtype": "float32", "num_kv_blocks": 256, "block_size": 4, "max_model_len": 128}
    prompts = [f"a b c {i} a b c {i} a b" for i in range(CPU_ROWS + 4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = tokens(LLM(**base), prompts, params)
    llm = LLM(**base, speculative_config=spec(4))
    assert tokens(llm, prompts, params) == want
    assert llm.llm_engine.scheduler.get_stats().spec_decode.num_drafts == 0
    assert tokens(llm, prompts[:3], params) == want[:3]
    s = llm.llm_engine.scheduler.get_stats().spec_decode
    assert s.num_drafts > 0
    check_pool_whole(llm)


@pytest.mark.parametrize("block_size", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_suffix_greedy_same_with_chunked_prefill_and_prefix_caching(block_size: int,
                                                                    reference: list[list[int]]) -> None:
    """Method suffix: the same greedy tokens; the second pass over the prompts also finds the first
    pass's outputs in the cache of finished requests, and more of its proposals land."""
    llm = LLM(**{**ROOMY, "block_size": block_size, "num_kv_blocks": 2048 // block_size},
              max_num_batched_tokens=24, enable_prefix_caching=True, speculative_config={"method": "suffix"})
    assert tokens(llm) == reference
    first = llm.llm_engine.scheduler.get_stats().spec_decode.copy()
    assert first.num_accepted_tokens > 0
    assert tokens(llm) == reference
    stats = llm.llm_engine.scheduler.get_stats()
    second = stats.spec_decode
    assert second.num_accepted_tokens - first.num_accepted_tokens > first.num_accepted_tokens
    if block_size == 16:  # the shared system prompt fills a block of 16, not one of 64
        assert stats.prefix_cache_hits > 0
    check_pool_whole(llm)
