"""Structured output on the real default model through the offline `LLM` API.

The oracle is independent of pagedllm: `jsonschema` validates every JSON reply that ends with
"stop" against its schema, Python's `re.fullmatch` checks regex replies. Exact comparisons are of
pagedllm with itself (the same constrained requests with and without preemption, prefix caching
and chunked prefill give the same tokens)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.benchmarks.schemas import CHOICES, REGEXES, schema_prompt, varied_schemas

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)


def constrained(**kwargs: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


# 5: every kind of schema once (the fifth shares a $defs entry); the sweep of 48 in the slow suite.
@pytest.mark.parametrize("count", [5, pytest.param(48, marks=pytest.mark.slow)])
def test_varied_schemas_all_validate(llm: LLM, count: int) -> None:
    schemas = varied_schemas(count, seed=7)
    params = [SamplingParams(max_tokens=128, temperature=0.8, seed=i, structured_outputs=constrained(json=s))
              for i, s in enumerate(schemas)]
    outs = llm.generate([schema_prompt(s) for s in schemas], params, use_tqdm=False)
    stopped = 0
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(c.text), schema)
    assert stopped >= len(schemas) // 2
    assert not llm.llm_engine.core._structured  # finished requests left the engine core's table


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    greedy = dict(max_tokens=40, temperature=0.0)
    params = [SamplingParams(**greedy, structured_outputs=constrained(regex=r)) for r in REGEXES]
    params += [SamplingParams(**greedy, structured_outputs=constrained(choice=c)) for c in CHOICES]
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    params.append(SamplingParams(**greedy, structured_outputs=constrained(grammar=grammar)))
    params.append(SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=constrained(json_object=True)))
    prompts = ["Answer:"] * len(params)
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for r, text in zip(REGEXES, texts):
        assert re.fullmatch(r, text), (r, text)
    for c, text in zip(CHOICES, texts[len(REGEXES):]):
        assert text in c
    assert re.fullmatch(r"The answer is (yes|no)\.", texts[-2])
    if outs[-1].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[-1]), dict)


def test_constrained_logprobs_are_of_the_constrained_distribution(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=5,
                            structured_outputs=constrained(choice=["yes", "no"]))
    out = llm.generate(["Is the sky blue?"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    tok = llm.get_tokenizer()
    first = out.logprobs[0]
    finite = {t for t, lp in first.items() if lp.logprob > float("-inf")}
    # Only tokens that start a choice have a probability; they sum to one.
    assert all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in finite)
    import math

    assert abs(sum(math.exp(first[t].logprob) for t in finite) - 1.0) < 1e-3 or len(first) == 6


def test_length_cap_mid_structure_is_length(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=constrained(json=PERSON))
    out = llm.generate(["A person:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_n_samples_with_a_seed_each_follow_the_schema(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=80, temperature=1.0, seed=11, structured_outputs=constrained(json=PERSON))
    first = llm.generate([schema_prompt(PERSON)], params, use_tqdm=False)[0]
    again = llm.generate([schema_prompt(PERSON)], params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    for c in first.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), PERSON)


def test_bad_structures_are_value_errors_naming_the_problem(llm: LLM) -> None:
    bad = [
        (constrained(regex="a(b"), "parenthesis"),
        (constrained(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (constrained(json={"type": "nonsense"}), "nonsense"),
        (constrained(grammar="root ::= undefined_rule"), "undefined_rule"),
        (constrained(json='{"type": "object",'), "not valid JSON"),
    ]
    for sop, needle in bad:
        with pytest.raises(ValueError, match=re.escape(needle)):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=sop), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    # The engine is still serving.
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_schemas_xgrammar_cannot_enforce_go_to_llguidance(llm: LLM) -> None:
    from pagedllm.structured_output import choose_backend

    all_of = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
    assert choose_backend(constrained(json=all_of), "auto") == "guidance"
    assert choose_backend(constrained(json=PERSON), "auto") == "xgrammar"
    with pytest.raises(ValueError, match="disable_fallback"):
        choose_backend(constrained(json=all_of, disable_fallback=True), "auto")
    out = llm.generate([schema_prompt(all_of)], SamplingParams(max_tokens=40, temperature=0.0,
                                                                structured_outputs=constrained(json=all_of)),
                       use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), all_of)


def _run(llm: LLM, schemas: list[dict]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=constrained(json=s)) for s in schemas]
    return [o.outputs[0].token_ids for o in llm.generate([schema_prompt(s) for s in schemas], params, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_same_tokens_under_preemption_and_chunked_prefill(llm: LLM, mode: str) -> None:
    """The matcher's state survives preemption: the constrained replies are the same tokens as in a
    roomy engine, with prompts chunked 32 tokens a step and prefix caching on. Four requests
    outgrow the 24 blocks together (the assertion on preemptions checks that they did)."""
    schemas = varied_schemas(4, seed=3)
    expected = _run(llm, schemas)
    tight = LLM(dtype="float32", num_kv_blocks=24, block_size=16, max_model_len=512, preemption_mode=mode,
                swap_space=0.05, max_num_batched_tokens=32, long_prefill_token_threshold=32)
    assert _run(tight, schemas) == expected
    assert tight.llm_engine.scheduler.get_stats().num_preemptions > 0


def test_guidance_backend_engine(llm: LLM) -> None:
    g = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024,
            structured_outputs_config={"backend": "guidance"})
    schemas = varied_schemas(5, seed=5)  # every kind of schema once (the fifth shares a $defs entry)
    params = [SamplingParams(max_tokens=96, temperature=0.7, seed=i, structured_outputs=constrained(json=s))
              for i, s in enumerate(schemas)]
    for s, o in zip(schemas, g.generate([schema_prompt(s) for s in schemas], params, use_tqdm=False)):
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), s)
    text = g.generate(["Code:"], SamplingParams(max_tokens=20, temperature=0, structured_outputs=constrained(
        regex=r"[A-Z]{3}-\d{2}")), use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", text)
    for grammar in ('start: "The answer is " ("yes" | "no")', 'root ::= "The answer is " ("yes" | "no")'):
        text = g.generate(["Answer:"], SamplingParams(max_tokens=20, temperature=0, structured_outputs=constrained(
            grammar=grammar)), use_tqdm=False)[0].outputs[0].text  # Lark, and GBNF converted to Lark
        assert re.fullmatch("The answer is (yes|no)", text), text


def test_structural_tag_constrains_only_its_tagged_regions(llm: LLM) -> None:
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "end": "</function>",
         "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"], "additionalProperties": False}}]}
    prompt = 'Call get_weather for Paris: <function=get_weather>{"city": "Paris"}</function>\n' * 2
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=constrained(
        structural_tag=json.dumps(tag))), use_tqdm=False)[0].outputs[0]
    for m in re.finditer(r"<function=get_weather>(.*?)</function>", out.text, re.S):
        assert set(json.loads(m.group(1))) == {"city"}
    with pytest.raises(ValueError, match="structural_tag"):
        llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=constrained(structural_tag="{")),
                     use_tqdm=False)
