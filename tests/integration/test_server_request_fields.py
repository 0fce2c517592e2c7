"""vLLM's request fields on a real `pagedllm serve` (the default model): each one is honoured, with
an observable effect checked here, or answered 400 with `param` naming it; and the structured-output
fields through the official openai SDK.

Oracles independent of pagedllm: `jsonschema` for JSON replies, `re.fullmatch` for regex replies,
the server's /tokenize and /detokenize for truncation and token ids, pydantic for `.parse()`.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server_helpers import assert_error_shape, serve

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "city"],
    "additionalProperties": False,
}
# The model's own template (ChatML) plus the RAG documents that vLLM's `documents` field passes.
TEMPLATE = (
    "{% for d in documents or [] %}<|im_start|>system\nDocument {{ d.title }}: {{ d.text }}<|im_end|>\n"
    "{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (continue_final_message and loop.last) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# vLLM's documented request fields (vllm/entrypoints/openai/completion/protocol.py and
# chat_completion/protocol.py: CompletionRequest and ChatCompletionRequest), plus the older
# guided_* names and logits_processors that earlier vLLM releases documented.
VLLM_COMPLETION_FIELDS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
    "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens",
    "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "logits_processors",
]
VLLM_CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
    "thinking_token_budget", "include_reasoning", "parallel_tool_calls", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
    "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_prompt_text", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "stream_interval",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "logits_processors",
]
# OpenAI's own fields and vLLM sampling fields that tests/integration/test_server.py and
# test_server_bad_input.py already exercise; tool and reasoning fields belong to the tool-calling
# and reasoning tests.
COVERED_ELSEWHERE = {
    "model", "prompt", "messages", "echo@completions", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "allowed_token_ids", "add_special_tokens@completions", "priority",
    "cache_salt", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools",
    "tool_choice", "parallel_tool_calls", "reasoning_effort", "include_reasoning",
}

# Fields answered 400 whenever set to anything but their no-op value: (field, value).
REFUSED = [
    ("use_beam_search", True), ("watermarking", True), ("length_penalty", 0.5), ("bad_words", ["sky"]),
    ("logprob_token_ids", [5]), ("logits_processors", ["x.y"]), ("session_id", "s1"),
    ("kv_transfer_params", {"do_remote_prefill": True}), ("ec_transfer_params", {"a": 1}),
    ("vllm_xargs", {"k": 1}), ("repetition_detection", {"max_pattern_size": 4}), ("stream_interval", 4),
    ("routed_experts_prompt_start", 2), ("return_token_offsets", True), ("return_mm_kwargs", False),
    ("return_tokens_as_token_ids", True), ("guided_decoding_backend", "outlines"),
    ("thinking_token_budget", 16), ("truncate_prompt_tokens", 0),
]
REFUSED_COMPLETION = REFUSED + [("prompt_embeds", "AAAA")]
REFUSED_CHAT = REFUSED + [
    ("chat_template", "{{ messages }}"), ("media_io_kwargs", {"image": {}}), ("mm_processor_kwargs", {"a": 1}),
    ("return_prompt_text", True), ("return_token_ids", True),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("request-fields")
    (d / "template.jinja").write_text(TEMPLATE)
    with serve(d, "--kv-cache-memory", "256MiB", "--dtype", "float32", "--max-model-len", "1024",
               "--chat-template", str(d / "template.jinja")) as s:
        yield s


def post(http: httpx.Client, path: str, **body: Any) -> dict:
    base = {"prompt": "The sky is"} if path == COMP else {"messages": MSG}
    r = http.post(path, json={**base, "temperature": 0, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http: httpx.Client, path: str, param: str, **body: Any) -> str:
    base = {"prompt": "The sky is"} if path == COMP else {"messages": MSG}
    r = http.post(path, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, (body, r.text)
    assert_error_shape(r.json())
    err = r.json()["error"]
    assert err["param"] == param, (body, err)
    return err["message"]


def tokenize(http: httpx.Client, text: str, add_special_tokens: bool = True) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def detokenize(http: httpx.Client, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


# ---- honoured: one check of its effect per field ------------------------------------------------
def check_structures(http: httpx.Client, path: str) -> None:
    """Each constrained request checked alone; they are sent at once (the server batches them, and
    a greedy reply is the same token for token whatever else runs beside it)."""
    def text(r: dict) -> str:
        c = r["choices"][0]
        return c["text"] if path == COMP else c["message"]["content"]

    ask = {"prompt": "A person as JSON:"} if path == COMP else {
        "messages": [{"role": "user", "content": "Give a person's name and city as JSON."}]}
    json_bodies = ({"guided_json": PERSON},
                   {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
                   {"guided_json": PERSON, "guided_decoding_backend": "auto"})
    bodies = [{"guided_choice": ["yes", "no"]}, {"guided_regex": r"[0-9]{3}-[a-z]{2}"},
              {"guided_grammar": 'root ::= "It is " ("blue" | "red") "."'},
              {"structured_outputs": {"choice": ["cat", "dog"]}}, {"structured_outputs": {"regex": "[A-Z]{4}"}},
              *({"max_tokens": 100, **ask, **body} for body in json_bodies),
              {"max_tokens": 60, **ask, "response_format": {"type": "json_object"}},
              {"response_format": {"type": "text"}}, {}]
    with ThreadPoolExecutor(len(bodies)) as pool:
        (choice, regex, grammar, choice2, regex2, *rest) = pool.map(lambda body: post(http, path, **body), bodies)
    json_replies, (obj, plain, unconstrained) = rest[:len(json_bodies)], rest[len(json_bodies):]

    assert text(choice) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text(regex))
    assert text(grammar) in ("It is blue.", "It is red.")
    assert text(choice2) in ("cat", "dog")
    assert re.fullmatch(r"[A-Z]{4}", text(regex2))
    for r in json_replies:
        assert r["choices"][0]["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(text(r)), PERSON)
    compact = text(json_replies[1])
    assert compact == json.dumps(json.loads(compact)), compact  # no free whitespace: one space after , and :
    if obj["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text(obj)), dict)
    else:
        assert text(obj).lstrip().startswith("{")
    assert plain == {**plain, "choices": unconstrained["choices"]}  # text is no constraint


@pytest.mark.slow
def test_structured_output_fields_on_completions(http: httpx.Client) -> None:
    check_structures(http, COMP)


def test_structured_output_fields_on_chat(http: httpx.Client) -> None:
    check_structures(http, CHAT)


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_prompt_logprobs_in_vllms_shape(http: httpx.Client, path: str) -> None:
    r = post(http, path, prompt_logprobs=2, max_tokens=2)
    plp = r["choices"][0]["prompt_logprobs"] if path == COMP else r["prompt_logprobs"]
    n = r["usage"]["prompt_tokens"]
    assert len(plp) == n and plp[0] is None
    if path == COMP:
        ids = tokenize(http, "The sky is")
        assert len(ids) == n
    for i, pos in enumerate(plp[1:], start=1):
        ranks = sorted(v["rank"] for v in pos.values())
        assert ranks[:2] == [1, 2] and len(pos) in (2, 3), pos
        best = max(pos.values(), key=lambda v: v["logprob"])
        assert best["rank"] == 1 and all(v["logprob"] <= 0 for v in pos.values())
        assert all(isinstance(v["decoded_token"], str) for v in pos.values())
        if path == COMP:
            assert str(ids[i]) in pos  # the prompt's own token is always there
    if path == COMP:
        # The same numbers as the legacy echo logprobs of the same prompt.
        echo = post(http, path, echo=True, logprobs=0, max_tokens=1)["choices"][0]["logprobs"]["token_logprobs"]
        for i in range(1, n):
            assert plp[i][str(ids[i])]["logprob"] == pytest.approx(echo[i], abs=1e-4)
    assert "prompt_logprobs" not in json.dumps(post(http, path, max_tokens=1))
    refused(http, path, "prompt_logprobs", prompt_logprobs=1, stream=True)
    refused(http, path, "prompt_logprobs", prompt_logprobs=-2)
    refused(http, path, "prompt_logprobs", prompt_logprobs=-1)


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client) -> None:
    prompt = "One two three four five six seven eight nine ten"
    ids = tokenize(http, prompt)
    r = post(http, COMP, prompt=prompt, truncate_prompt_tokens=4, echo=True, max_tokens=1)
    assert r["usage"]["prompt_tokens"] == 4
    assert r["choices"][0]["text"].startswith(detokenize(http, ids[-4:]))
    r = post(http, COMP, prompt=prompt, truncate_prompt_tokens=3, truncation_side="right", echo=True, max_tokens=1)
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"].startswith(detokenize(http, ids[:3]))
    assert post(http, COMP, prompt=prompt, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(ids)
    assert post(http, COMP, prompt=[5] * 1100, truncate_prompt_tokens=-1, max_tokens=4)["usage"][
        "prompt_tokens"] == 1020
    chat = post(http, CHAT, truncate_prompt_tokens=5)
    assert chat["usage"]["prompt_tokens"] == 5
    refused(http, COMP, "truncate_prompt_tokens", truncate_prompt_tokens=2000)
    refused(http, COMP, "truncate_prompt_tokens", truncate_prompt_tokens=-3)


def test_request_id_and_token_ids(http: httpx.Client) -> None:
    r = post(http, COMP, request_id="my-req-1", return_token_ids=True)
    assert r["id"] == "cmpl-my-req-1"
    c = r["choices"][0]
    assert c["prompt_token_ids"] == tokenize(http, "The sky is")
    assert len(c["token_ids"]) == r["usage"]["completion_tokens"] and detokenize(http, c["token_ids"]) == c["text"]
    assert post(http, CHAT, request_id="my-req-2")["id"] == "chatcmpl-my-req-2"
    # Streamed: the prompt's ids with the first chunk, each chunk's new ids with it.
    with http.stream("POST", COMP, json={"prompt": "The sky is", "max_tokens": 6, "temperature": 0,
                                         "stream": True, "return_token_ids": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    got = [t for ch in chunks for t in ch["choices"][0]["token_ids"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == c["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch["choices"][0] for ch in chunks[1:])
    assert got[:6] == c["token_ids"][:6]


def test_chat_echo_documents_and_add_special_tokens(http: httpx.Client) -> None:
    prefill = MSG + [{"role": "assistant", "content": "The answer is"}]
    body = dict(messages=prefill, add_generation_prompt=False, continue_final_message=True)
    plain = post(http, CHAT, **body)["choices"][0]["message"]["content"]
    echoed = post(http, CHAT, echo=True, **body)["choices"][0]["message"]["content"]
    assert echoed == "The answer is" + plain
    # Echo needs the last message to have the reply's role: a user message last is not echoed.
    assert post(http, CHAT, echo=True)["choices"][0]["message"]["content"] == post(http, CHAT)["choices"][0][
        "message"]["content"]
    with http.stream("POST", CHAT, json={**body, "echo": True, "stream": True, "max_tokens": 8,
                                         "temperature": 0}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[1]["choices"][0]["delta"] == {"content": "The answer is"}
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == echoed
    docs = [{"title": "Sky", "text": "The sky is green on this planet."}]
    with_docs = post(http, CHAT, documents=docs)["usage"]["prompt_tokens"]
    doc_tokens = len(tokenize(http, "<|im_start|>system\nDocument Sky: The sky is green on this planet.<|im_end|>\n",
                              add_special_tokens=False))
    assert with_docs == post(http, CHAT)["usage"]["prompt_tokens"] + doc_tokens
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MSG) + "<|im_start|>assistant\n"
    assert post(http, CHAT, add_special_tokens=True)["usage"]["prompt_tokens"] == len(tokenize(http, rendered, True))


# ---- refused: 400 naming the field --------------------------------------------------------------
@pytest.mark.parametrize("path,cases", [(COMP, REFUSED_COMPLETION), (CHAT, REFUSED_CHAT)], ids=["completions", "chat"])
def test_unhonourable_fields_are_400_naming_them(http: httpx.Client, path: str, cases: list) -> None:
    for name, value in cases:
        refused(http, path, name, **{name: value})
    # Their no-op values are accepted.
    post(http, path, use_beam_search=False, length_penalty=1.0, bad_words=[], watermarking=False,
         routed_experts_prompt_start=0, return_mm_kwargs=True, stream_interval=1, thinking_token_budget=-1)


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_bad_structures_are_400_naming_the_field(http: httpx.Client, path: str) -> None:
    assert "regex" in refused(http, path, "guided_regex", guided_regex="(unclosed")
    refused(http, path, "guided_json", guided_json={"type": "object", "properties": {"a": {"type": "nonsense"}}})
    refused(http, path, "structured_outputs", structured_outputs={"grammar": "root ::= ("})
    refused(http, path, "structured_outputs", structured_outputs={"jsn": {}})
    refused(http, path, "structured_outputs", structured_outputs={"choice": []})
    refused(http, path, "structured_outputs", structured_outputs={"disable_any_whitespace": True})
    refused(http, path, "response_format.type", response_format={"type": "xml"})
    refused(http, path, "response_format", response_format={"type": "json_schema"})
    refused(http, path, "response_format", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    msg = refused(http, path, "response_format", response_format={"type": "json_object"}, guided_regex="a+")
    assert "guided_regex" in msg
    refused(http, path, "guided_json", guided_json=PERSON, guided_choice=["a"])


def test_every_vllm_field_is_tested() -> None:
    handled = {n for n, _ in REFUSED_COMPLETION + REFUSED_CHAT} | {
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "thinking_token_budget", "prompt_logprobs",
        "truncate_prompt_tokens", "truncation_side", "request_id", "return_token_ids", "echo@chat",
        "documents", "add_special_tokens@chat", "chat_template",
    }
    for endpoint, fields in (("completions", VLLM_COMPLETION_FIELDS), ("chat", VLLM_CHAT_FIELDS)):
        for f in fields:
            keys = {f, f"{f}@{endpoint}"}
            assert keys & (handled | COVERED_ELSEWHERE), f"{endpoint}: {f} is not tested"


# ---- the openai SDK -----------------------------------------------------------------------------
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)


def test_sdk_chat_parse_json_schema_and_json_object(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Name a city in France as JSON."}]
    parsed = client.chat.completions.parse(model="", messages=msgs, response_format=City, temperature=0,
                                           max_tokens=60)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City)
    strict = client.chat.completions.create(
        model="", messages=msgs, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True,
                                                                "schema": City.model_json_schema()}})
    jsonschema.validate(json.loads(strict.choices[0].message.content), City.model_json_schema())
    obj = client.chat.completions.create(model="", messages=msgs, temperature=0, max_tokens=80,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_sdk_completions_guided_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(model="", prompt="The sky is", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["blue", "grey"]})
    assert r.choices[0].text in ("blue", "grey")
    r = client.completions.create(model="", prompt="Year:", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": r"(19|20)[0-9]{2}"})
    assert re.fullmatch(r"(19|20)[0-9]{2}", r.choices[0].text)
    r = client.completions.create(model="", prompt="A person:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    assert e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "object", "required": 5}})
    assert e.value.body["param"] == "guided_json"
