"""Speculative method draft_model: a draft model decodes proposals on the worker and the target
verifies them. Greedy outputs are the same token for token as without speculation (the target
itself as its own draft, accepting nearly everything; the target quantized to int4; a separate
tiny draft of another shape), at block sizes 16 and 64, with chunked prefill, prefix caching and
preemption; seeded sampling repeats itself; the KV pool is sized for both caches; a quantized
draft's LM head runs from codes of its scheme while the target's stays dense; a step without
proposals runs no draft pass, and a request the draft skipped catches up when it speculates; bad
configs are refused naming what is wrong."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs, parse_speculative_config
from pagedllm.models.testing import make_tiny_checkpoint

SYSTEM = (
    "You are a helpful assistant for a small bakery. You answer questions about bread, cakes, opening "
    "hours and prices politely and briefly. "
) * 3  # past a block of 64 tokens
PROMPTS = [SYSTEM + "What time do you open?", SYSTEM + "Do you sell bread?", "The quick brown fox",
           "Write a short poem about the sea."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BASE = {"dtype": "float32", "max_model_len": 256}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draft(k: int = 3, **extra: object) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, **extra}


def tokens(llm: LLM, prompts: list[str] = PROMPTS, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def check_pool_whole(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.kv.req_blocks


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return tokens(LLM(**BASE, num_kv_blocks=128, block_size=16))


# The int8 draft (its head as int8 codes) runs in the slow suite; int4 keeps a quantized draft here.
@pytest.mark.parametrize("block_size,quantization,budget", [(16, None, 48), (64, "int4", 40),
                                                            pytest.param(16, "int8", 48, marks=pytest.mark.slow)])
def test_greedy_same_with_draft(block_size: int, quantization: str | None, budget: int,
                                reference: list[list[int]]) -> None:
    """Chunked prefill (a budget under the prompts' length) and prefix caching (the bakery prompts
    share their system prompt) with the draft computing the same chunks."""
    blocks = 128 * 16 // block_size
    llm = LLM(**BASE, num_kv_blocks=blocks, block_size=block_size, max_num_batched_tokens=budget,
              speculative_config=draft(3, quantization=quantization))
    assert tokens(llm) == reference
    runner = llm.llm_engine.executor.runner
    assert runner.model.lm_head.quant_codes is None  # the target's head as stored
    head = runner.draft.model.lm_head
    if quantization is not None:  # the draft's head as codes of its scheme, beside the dense weight
        assert head.dense and head.qlayout[0] == {"int4": 4, "int8": 8}[quantization]
        assert runner.draft.native is not None and runner.draft.native.model.lm_head_q
    else:
        assert head.quant_codes is None
    stats = llm.llm_engine.scheduler.get_stats()
    s = stats.spec_decode
    assert s.num_drafts > 10, s
    if quantization is None:  # the target is its own draft: every proposal is its own argmax
        assert s.acceptance_rate > 0.95, s
    else:
        assert s.acceptance_rate > 0.3, s
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert stats.prefix_cache_hits > 0
    check_pool_whole(llm)
    # a second pass over the same prompts: the whole prompts come from the prefix cache, the draft's
    # K/V with them, so the self-draft still accepts nearly everything
    before = llm.llm_engine.scheduler.get_stats().spec_decode
    assert tokens(llm) == reference
    after = llm.llm_engine.scheduler.get_stats().spec_decode
    rate = (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)
    assert rate > (0.95 if quantization is None else 0.3), (before, after)


def test_no_draft_pass_without_proposals() -> None:
    """32 running requests fill the rows a CPU step takes with proposals (core/spec_adaptive.py):
    none proposes, and the draft runs no pass at all, the outputs those without speculation. A
    request that then speculates alone, on the prompt blocks the target computed without the
    draft (prefix-cache hits), has the draft catch up over its whole prompt first: the target as
    its own draft accepts nearly everything."""
    prompts = [f"{PROMPTS[i % 4]} ({i})" for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = {**BASE, "num_kv_blocks": 256, "block_size": 16, "max_num_batched_tokens": 4096, "max_num_seqs": 64}
    plain = LLM(**engine)
    want = tokens(plain, prompts, params)
    llm = LLM(**engine, speculative_config=draft(3))
    d = llm.llm_engine.executor.runner.draft
    assert tokens(llm, prompts, params) == want
    assert d.passes == 0 and not d.computed and not d.valid
    assert llm.llm_engine.scheduler.get_stats().spec_decode.num_drafts == 0
    assert tokens(llm, prompts[:1], GREEDY) == tokens(plain, prompts[:1], GREEDY)
    s = llm.llm_engine.scheduler.get_stats()
    assert d.passes > 0 and s.prefix_cache_hits > 0 and s.spec_decode.acceptance_rate > 0.95, s
    check_pool_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_same_under_preemption(mode: str, reference: list[list[int]]) -> None:
    """A KV pool of 12 blocks of 16 tokens holds about two requests: requests are preempted
    (recompute, or swap: the draft's K/V goes to the host pool and back with the target's) while
    speculating and resume with the same tokens; the target as its own draft still accepts nearly
    everything, so the draft's K/V a resumed request starts from is its own."""
    llm = LLM(**BASE, num_kv_blocks=12, block_size=16, max_num_seqs=4, speculative_config=draft(3),
              preemption_mode=mode, swap_space=0.05)
    assert tokens(llm) == reference
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats.num_preemptions_by_mode[mode] > 0 and stats.spec_decode.acceptance_rate > 0.95, stats
    check_pool_whole(llm)


def test_seeded_sampling_repeats() -> None:
    """Seeded sampled requests (n > 1 among them) run through verification by rejection sampling
    and repeat themselves; the per-position counts add up. Without prefix caching, so that the
    second run's steps are the first's: how many uniforms a request draws follows its proposals,
    and a draft's argmax may flip between two batch layouts where its top two logits nearly tie."""
    llm = LLM(**BASE, num_kv_blocks=128, block_size=16, enable_prefix_caching=False,
              speculative_config=draft(3, quantization="int4"))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=11, ignore_eos=True, n=2)
    first = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    again = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    assert first == again and all(len(t) == 24 for o in first for t in o)
    s = llm.llm_engine.scheduler.get_stats().spec_decode
    assert s.num_drafts > 0 and sum(s.accepted_per_position) == s.num_accepted_tokens, s
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:])), s
    check_pool_whole(llm)


def test_kv_pool_holds_both_caches(tmp_path) -> None:
    """A block's bytes are the target's and the draft's: the same KV budget holds half as many
    blocks with the unquantized target as its own draft (the same KV shape twice; a tiny target,
    as the sizing reads only the two KV shapes)."""
    target = make_tiny_checkpoint(str(tmp_path / "target"), "qwen2", seed=0)
    budget = 1 << 20
    plain = LLM(model=target, **BASE, kv_cache_memory=budget, block_size=16)
    both = LLM(model=target, **BASE, kv_cache_memory=budget, block_size=16, speculative_config=draft(2))
    assert both.llm_engine.executor.runner.draft is not None
    assert both.llm_engine.scheduler.kv.num_blocks == plain.llm_engine.scheduler.kv.num_blocks // 2


def test_separate_tiny_draft(tmp_path) -> None:
    """A draft of another architecture and head shape sharing the target's vocabulary: the
    target's greedy tokens, whatever the draft proposes."""
    target = make_tiny_checkpoint(str(tmp_path / "target"), "qwen2", seed=0)
    other = make_tiny_checkpoint(str(tmp_path / "draft"), "llama", seed=1, num_attention_heads=2,
                                 num_key_value_heads=1)
    prompts = ["hello world", "a b c d e f g"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = tokens(LLM(model=target, **BASE, num_kv_blocks=64, block_size=16), prompts, params)
    llm = LLM(model=target, **BASE, num_kv_blocks=64, block_size=16,
              speculative_config={"model": other, "num_speculative_tokens": 2})  # method inferred from "model"
    assert tokens(llm, prompts, params) == want
    assert llm.llm_engine.scheduler.get_stats().spec_decode.num_drafts > 0
    check_pool_whole(llm)


def test_bad_configs(tmp_path) -> None:
    target = make_tiny_checkpoint(str(tmp_path / "target"), "qwen2", seed=0)
    wide = make_tiny_checkpoint(str(tmp_path / "wide"), "qwen2", seed=0, vocab_size=512)
    with pytest.raises(ValueError, match=r"vocabulary of 512 tokens.*one of 3\d\d"):
        EngineArgs(model=target, speculative_config=parse_speculative_config(
            {"model": wide, "num_speculative_tokens": 2})).create_engine_config()
    with pytest.raises(ValueError, match=r"unknown keys \['draft_model_path'\]"):
        parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 2, "draft_model_path": "x"})
    with pytest.raises(ValueError, match=r"\['quantization'\] apply to method 'draft_model' only"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int4"})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        parse_speculative_config(draft(2, draft_tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"\['prompt_lookup_max'\] do not apply"):
        parse_speculative_config(draft(2, prompt_lookup_max=3))
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        parse_speculative_config({"method": "draft_model"})
    with pytest.raises(ValueError, match="quantization must be one of"):
        parse_speculative_config(draft(2, quantization="int3"))
