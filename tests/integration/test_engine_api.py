"""The offline API end to end on real models: prompt forms, ordering, batch and chunking
invariance, stop rules, seeds, n > 1, logprobs, bad input and abort."""

from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import RequestOutput

MAX_MODEL_LEN = 1024
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

# 16 plain-text prompts of clearly different lengths (a few tokens up to ~90).
PROMPTS = [
    "Hi",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village at the foot of the mountains, there lived",
    "def fibonacci(n):",
    "The quick brown fox",
    "Explain in simple words why the sky is blue. Mention the scattering of light by the molecules of "
    "the atmosphere, and why sunsets look red. Keep the answer to a few sentences, suitable for a child "
    "of ten who is curious about science and asks many questions.",
    "List three prime numbers:",
    "Water boils at",
    "Write a short poem about the sea and the wind, in four lines, with a rhyme at the end of each line.",
    "My favourite food is",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The three primary colours are red,",
    "A journey of a thousand miles begins with",
    "In 1969, the first humans to walk on the Moon were Neil Armstrong and",
    "Dear hiring manager, I am writing to apply for the position of software engineer at your company. "
    "I have five years of experience building",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The default model with a large token budget (whole prompts in one step)."""
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def chunked_llm() -> LLM:
    """The default model with a 24-token budget: every longer prompt is prefilled in chunks."""
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=128 << 20, max_num_batched_tokens=24)


def assert_idle(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.output_processor.requests == {}
    assert engine.scheduler.kv.usage == 0  # cached-but-free prefix blocks count as free


def assert_still_works(llm: LLM) -> None:
    assert_idle(llm)
    (out,) = llm.generate("Hello, my name is", GREEDY, use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert_idle(llm)


def assert_length_finished(out: RequestOutput, max_tokens: int) -> None:
    assert out.finished
    (c,) = out.outputs
    assert c.finish_reason == "length"
    assert c.stop_reason is None
    assert len(c.token_ids) == max_tokens
    assert c.text


# ---- prompt forms and ordering --------------------------------------------------------------


def test_prompt_forms_and_input_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    texts = ["The quick brown fox", "Hi", "1, 2, 3, 4, 5, 6, 7, 8,"]
    ids = [tok.encode(t) for t in texts]

    (single,) = llm.generate(texts[0], GREEDY, use_tqdm=False)
    assert single.prompt == texts[0] and single.prompt_token_ids == ids[0]
    assert_length_finished(single, GREEDY.max_tokens)

    (from_ids,) = llm.generate(ids[0], GREEDY, use_tqdm=False)
    assert from_ids.prompt_token_ids == ids[0]
    assert from_ids.outputs[0].token_ids == single.outputs[0].token_ids

    for (d,) in (
        llm.generate({"prompt": texts[0]}, GREEDY, use_tqdm=False),
        llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False),
    ):
        assert d.prompt_token_ids == ids[0]
        assert d.outputs[0].token_ids == single.outputs[0].token_ids

    forms = [
        texts,
        ids,
        [{"prompt": t} for t in texts],
        [{"prompt_token_ids": i} for i in ids],
        [texts[0], ids[1], {"prompt": texts[2]}],  # mixed forms in one batch
    ]
    for prompts in forms:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == ids
        rids = [int(o.request_id) for o in outs]
        assert rids == sorted(rids) and len(set(rids)) == len(rids)
        for o in outs:
            assert_length_finished(o, GREEDY.max_tokens)
        assert outs[0].outputs[0].token_ids == single.outputs[0].token_ids

    # One SamplingParams per prompt: each output follows its own params, in input order.
    per_prompt = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 9, 5)]
    outs = llm.generate(texts, per_prompt, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ids
    for o, p in zip(outs, per_prompt):
        assert_length_finished(o, p.max_tokens)
    assert outs[0].outputs[0].token_ids == single.outputs[0].token_ids[:3]
    assert_idle(llm)


def test_chat_answers_paris(llm: LLM) -> None:
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    assert out.finished
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


def test_chat_passes_tools_and_template_kwargs(llm: LLM) -> None:
    """tools and chat_template_kwargs reach the template as transformers renders them."""
    template = ("{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}<{{ flavor }}>"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    (out,) = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=2), False, None, template,
                      tools=tools, chat_template_kwargs={"flavor": "dry"})
    hf = llm.get_tokenizer().hf.apply_chat_template(msgs, tokenize=False, chat_template=template, tools=tools,
                                                    flavor="dry", add_generation_prompt=True)
    assert out.prompt == hf == "[get_weather]<dry>Weather in Paris?"


# ---- batch and chunked-prefill invariance ---------------------------------------------------


def test_greedy_same_alone_batched_and_chunked(llm: LLM, chunked_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tok = llm.get_tokenizer()
    lengths = [len(tok.encode(p)) for p in PROMPTS]
    assert len(set(lengths)) >= 12 and max(lengths) > 2 * 24, lengths

    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    chunked = chunked_llm.generate(PROMPTS, params, use_tqdm=False)
    for i, p in enumerate(PROMPTS):
        assert batched[i].outputs[0].token_ids == chunked[i].outputs[0].token_ids, (i, p)
    # Alone: the shortest, the longest and two in between.
    order = sorted(range(len(PROMPTS)), key=lambda i: lengths[i])
    for i in (order[0], order[5], order[10], order[-1]):
        (alone,) = llm.generate(PROMPTS[i], params, use_tqdm=False)
        assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids, (i, PROMPTS[i])
    assert_idle(llm)
    assert_idle(chunked_llm)


# ---- stop rules -----------------------------------------------------------------------------

STOP_PROMPT = "Once upon a time, in a small village at the foot of the mountains, there lived"


def _stop_across_boundary(tok, token_ids: list[int], text: str) -> tuple[int, str, int]:
    """(k, stop, b): a 2-character stop string text[b-1:b+1] whose first character ends token k-1's
    text and whose second starts token k's; it occurs nowhere earlier in the text."""
    for k in range(2, len(token_ids) - 1):
        prefix = tok.decode(token_ids[:k])
        b = len(prefix)
        if not text.startswith(prefix) or not 1 <= b < len(text) - 1:
            continue
        if len(tok.decode(token_ids[: k + 1])) <= b:
            continue
        stop = text[b - 1 : b + 1]
        if stop.isascii() and stop.isalnum() and text.find(stop) == b - 1:
            return k, stop, b
    raise AssertionError(f"no stop string spans a token boundary in {text!r}")


def test_stop_string_across_token_boundary(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    (ref,) = llm.generate(STOP_PROMPT, base, use_tqdm=False)
    ids, text = ref.outputs[0].token_ids, ref.outputs[0].text
    k, stop, b = _stop_across_boundary(tok, ids, text)

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(STOP_PROMPT, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == text[: b - 1], (stop, c.text, text)
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == ids[: k + 1]  # generation ends with the token that completed the match
    assert_idle(llm)

    params = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, stop=["never appears", stop], include_stop_str_in_output=True
    )
    (out,) = llm.generate(STOP_PROMPT, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == text[: b + 1] and c.text.endswith(stop)
    assert c.finish_reason == "stop" and c.stop_reason == stop


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    (ref,) = llm.generate(STOP_PROMPT, base, use_tqdm=False)
    ids = ref.outputs[0].token_ids
    j = next(j for j in range(4, len(ids)) if ids.index(ids[j]) == j)  # first occurrence of its token
    stop_id = ids[j]

    (out,) = llm.generate(STOP_PROMPT, SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id]),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == ids[: j + 1]
    assert c.text == tok.decode(ids[:j])  # the stop token's text is left out

    # min_tokens keeps the stop id from being sampled (and from ending the request) too early.
    min_tokens = j + 3
    params = SamplingParams(temperature=0.0, max_tokens=min_tokens + 3, stop_token_ids=[stop_id],
                            min_tokens=min_tokens)
    (out,) = llm.generate(STOP_PROMPT, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids[:j] == ids[:j]
    assert stop_id not in c.token_ids[:min_tokens]
    assert len(c.token_ids) >= min_tokens

    # The same for EOS: the chat answer ends early with EOS; min_tokens pushes EOS out.
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    (short,) = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    sc = short.outputs[0]
    eos = llm.llm_engine.model_config.eos_token_ids
    assert sc.finish_reason == "stop" and sc.stop_reason is None and sc.token_ids[-1] in eos
    min_tokens = len(sc.token_ids) + 4
    (longer,) = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=min_tokens), use_tqdm=False)
    lc = longer.outputs[0]
    assert len(lc.token_ids) >= min_tokens
    assert not set(lc.token_ids[:min_tokens]) & eos
    assert lc.token_ids[: len(sc.token_ids) - 1] == sc.token_ids[:-1]
    assert_idle(llm)


# ---- seeds and n > 1 ------------------------------------------------------------------------


def test_seeded_sampling_independent_of_batch(llm: LLM) -> None:
    prompt = "Tell me about your favourite animal."
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    rand = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    (alone,) = llm.generate(prompt, seeded, use_tqdm=False)
    text = alone.outputs[0].text

    outs = llm.generate([PROMPTS[3], prompt, PROMPTS[6]], [rand, seeded, rand], use_tqdm=False)
    assert outs[1].outputs[0].text == text
    other = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    outs = llm.generate([PROMPTS[9], PROMPTS[0], "Hi there", prompt],
                        [other, rand, GREEDY, seeded], use_tqdm=False)
    assert outs[3].outputs[0].text == text
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids

    (different,) = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1235, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
    assert different.outputs[0].text != text
    assert_idle(llm)


def test_n_samples(llm: LLM) -> None:
    prompt = "My favourite colour is"
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    (first,) = llm.generate(prompt, params, use_tqdm=False)
    (second,) = llm.generate(prompt, params, use_tqdm=False)
    for out in (first, second):
        assert out.finished
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        for c in out.outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == 10
    texts = [c.text for c in first.outputs]
    assert len(set(texts)) == 4, texts
    assert [c.token_ids for c in second.outputs] == [c.token_ids for c in first.outputs]

    # Unseeded n > 1 batched with other prompts.
    outs = llm.generate(["Hi", prompt], [GREEDY, SamplingParams(n=3, temperature=0.8, max_tokens=5, ignore_eos=True)],
                        use_tqdm=False)
    assert len(outs[0].outputs) == 1
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in outs[1].outputs)
    assert_idle(llm)


# ---- logprobs -------------------------------------------------------------------------------


def test_sample_logprobs(llm: LLM) -> None:
    for params in (
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=3),
    ):
        (out,) = llm.generate("The three primary colours are", params, use_tqdm=False)
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 8
        total = 0.0
        for tid, d in zip(c.token_ids, c.logprobs):
            assert tid in d and len(d) in (3, 4)
            top = sorted((lp for t, lp in d.items() if t != tid or lp.rank <= 3), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top[:3]] == [1, 2, 3]
            values = [lp.logprob for lp in top]
            assert values == sorted(values, reverse=True)
            assert all(lp.logprob <= 0.0 and lp.decoded_token is not None for lp in d.values())
            if params.temperature == 0.0:
                assert d[tid].rank == 1
                assert d[tid].logprob == max(lp.logprob for lp in d.values())
            total += d[tid].logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    (plain,) = llm.generate("Hi", GREEDY, use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def _check_prompt_logprobs(out: RequestOutput, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and lps[0] is None
    assert len(lps) == len(out.prompt_token_ids)
    for tid, d in zip(out.prompt_token_ids[1:], lps[1:]):
        assert d is not None and tid in d and len(d) in (k, k + 1)
        assert all(math.isfinite(lp.logprob) and lp.logprob <= 0.0 for lp in d.values())


def test_prompt_logprobs_same_with_chunked_prefill(llm: LLM, chunked_llm: LLM) -> None:
    # A prompt no other test sends, so no prefix-cache hit interferes.
    prompt = "Summarize the rules of chess for a beginner. " + PROMPTS[6]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    (big,) = llm.generate(prompt, params, use_tqdm=False)
    (small,) = chunked_llm.generate(prompt, params, use_tqdm=False)
    assert len(big.prompt_token_ids) > 2 * 24
    _check_prompt_logprobs(big, 2)
    _check_prompt_logprobs(small, 2)
    for a, b in zip(big.prompt_logprobs[1:], small.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].rank == b[t].rank
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    assert big.outputs[0].token_ids == small.outputs[0].token_ids


def test_reset_prefix_cache_makes_the_next_request_prefill_in_full(llm: LLM) -> None:
    prompt = "A lighthouse keeper on a remote island kept a careful log of every ship that passed by at night"
    params = SamplingParams(temperature=0.0, max_tokens=3)
    (first,) = llm.generate(prompt, params, use_tqdm=False)
    (hit,) = llm.generate(prompt, params, use_tqdm=False)
    assert hit.num_cached_tokens >= 16  # at least one full block came from the cache
    assert llm.reset_prefix_cache() is True
    (fresh,) = llm.generate(prompt, params, use_tqdm=False)
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == hit.outputs[0].token_ids == first.outputs[0].token_ids
    assert_idle(llm)


def test_prompt_logprobs_complete_after_prefix_cache_hit(llm: LLM) -> None:
    # A request asking for prompt logprobs bypasses the prefix cache: cached positions would be
    # skipped and have no logprobs.
    prompt = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    (first,) = llm.generate(prompt, params, use_tqdm=False)
    (second,) = llm.generate(prompt, params, use_tqdm=False)
    _check_prompt_logprobs(first, 1)
    _check_prompt_logprobs(second, 1)

    def values(out):
        return [None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.prompt_logprobs]

    assert values(second) == values(first)  # the same numbers, not only the same shapes
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_not_repeated_after_preemption(tiny_model_dir: str) -> None:
    # 12 blocks of 4 tokens cannot hold four requests of 10-17 + 20 tokens: recompute preemption.
    tight = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=12, block_size=4, max_num_batched_tokens=16,
                max_model_len=256)
    roomy = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=16,
                max_model_len=256)
    prompts = [[(7 * i + 13 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((10, 17, 9, 14))]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    outs = tight.generate(prompts, params, use_tqdm=False)
    refs = roomy.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert roomy.llm_engine.scheduler.num_preemptions == 0
    for out, ref in zip(outs, refs):
        _check_prompt_logprobs(out, 1)
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=1e-4)


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_call, fragments",
    [
        (lambda llm: llm.generate("", GREEDY), ["empty"]),
        (lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY), ["empty"]),
        (lambda llm: llm.generate([1, 2, 10**6], GREEDY), ["1000000"]),
        (lambda llm: llm.generate([[5, 6], [7, -3]], GREEDY), ["-3"]),
        (lambda llm: llm.generate("Hi", SamplingParams(max_tokens=MAX_MODEL_LEN)), [str(MAX_MODEL_LEN)]),
        (lambda llm: llm.generate(["Hi", "Hello"], [GREEDY] * 3), ["3", "2"]),
        (lambda llm: llm.generate("Hi", SamplingParams(temperature=-1)), ["temperature", "-1"]),
        (lambda llm: llm.generate("Hi", SamplingParams(top_p=0)), ["top_p", "0"]),
        (lambda llm: llm.generate("Hi", SamplingParams(top_k=-5)), ["top_k", "-5"]),
        (lambda llm: llm.generate("Hi", SamplingParams(n=0)), ["n must", "0"]),
        (lambda llm: llm.generate("Hi", SamplingParams(stop_token_ids=[10**7])), ["10000000"]),
    ],
    ids=["empty-text", "empty-ids", "out-of-vocab", "negative-id", "too-long", "params-count", "temperature",
         "top_p", "top_k", "n", "stop-id-vocab"],
)
def test_bad_input_raises_and_engine_keeps_working(llm: LLM, make_call, fragments) -> None:
    with pytest.raises(ValueError) as info:
        make_call(llm)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))
    assert_still_works(llm)


def test_too_long_request_names_both_numbers(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Hello there, how are you?")
    max_tokens = MAX_MODEL_LEN - len(ids) + 1
    with pytest.raises(ValueError) as info:
        # The first prompt is valid and queued, then the batch is rejected as a whole.
        llm.generate(["Hi", ids], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    msg = str(info.value)
    assert str(MAX_MODEL_LEN) in msg and str(MAX_MODEL_LEN + 1) in msg, msg
    assert_still_works(llm)


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="/nonexistent"):
        LLM(model="/nonexistent")


# ---- abort ----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["large", "chunked"])
def test_abort_frees_everything(llm: LLM, chunked_llm: LLM, which: str) -> None:
    target = llm if which == "large" else chunked_llm
    engine = target.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    ids = [f"abort-{which}-{i}" for i in range(4)]
    for rid, prompt in zip(ids, PROMPTS[6:10]):
        engine.add_request(rid, prompt, params)
    engine.add_request(f"abort-{which}-n", "Hello", SamplingParams(n=3, temperature=1.0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests() and engine.scheduler.kv.usage > 0
    engine.abort_request(ids[:2])
    engine.step()
    engine.abort_request([*ids[2:], f"abort-{which}-n", "no-such-request"])
    assert_idle(target)
    assert engine.step() == []
    assert engine.executor.runner.requests == {}
    assert_still_works(target)


def test_memory_bound_is_stated_and_kv_cache_memory_keeps_its_meaning(llm: LLM) -> None:
    """kv_cache_memory=256 MiB gives a KV pool of at most 256 MiB (less than one block short), and
    the bound adds it to what the process holds once loaded, the swap pool and a step's workspace."""
    core = llm.llm_engine.core
    cc, mc = llm.llm_engine.config.cache_config, llm.llm_engine.model_config
    block = cc.block_size * mc.kv_bytes_per_token()
    b = core.memory_bound
    assert b.kv_cache == core.num_blocks * block and 256 << 20 >= b.kv_cache > (256 << 20) - block
    assert b.total == b.resident + b.kv_cache + b.swap + b.workspace
    assert 0 < b.weights < b.resident and b.workspace > 0
    text = b.describe()
    assert text.startswith(f"Memory bound of the engine core: {b.total / (1 << 30):.2f} GiB RSS at most")
    assert f"{b.kv_cache / (1 << 30):.2f} GiB KV cache" in text
