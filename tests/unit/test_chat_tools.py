"""The chat server's tool checks (tools, tool_choice, the enforced schemas), the reply split of
reasoning, content and calls (whole and streamed), and tools written into the default model's
chat template, which takes none."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.chat import (
    ChatReplyParser,
    resolve_tool_choice,
    tool_choice_schema,
    validate_tools,
)
from pagedllm.entrypoints.openai.tool_parsers.json_formats import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.prompt import template_uses_tools, tool_conversation
from pagedllm.reasoning import get_reasoning_parser

P = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": P}},
         {"type": "function", "function": {"name": "noop"}}]


def _400(fn, *args) -> str:
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value.message


def test_validate_tools() -> None:
    tools = validate_tools(TOOLS)
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert "'bad'" in _400(validate_tools, [{"type": "function", "function": {"name": "bad", "parameters": {"type": 3}}}])
    assert "'a b'" in _400(validate_tools, [{"type": "function", "function": {"name": "a b"}}])
    assert "x" * 65 in _400(validate_tools, [{"type": "function", "function": {"name": "x" * 65}}])
    assert "'function'" in _400(validate_tools, [{"type": "code_interpreter"}])
    assert "twice" in _400(validate_tools, TOOLS + TOOLS[:1])


def test_resolve_tool_choice() -> None:
    tools = validate_tools(TOOLS)
    assert resolve_tool_choice(None, [], False, None) == ("none", None)
    assert resolve_tool_choice("none", tools, False, None) == ("none", None)
    assert resolve_tool_choice("required", tools, False, None) == ("required", None)
    assert resolve_tool_choice(None, tools, True, "hermes") == ("auto", None)
    msg = _400(resolve_tool_choice, None, tools, False, None)
    assert "--enable-auto-tool-choice" in msg and "--tool-call-parser" in msg
    assert "--tool-call-parser" in _400(resolve_tool_choice, "auto", tools, True, None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert resolve_tool_choice(named, tools, False, None) == ("named", "get_weather")
    assert "'nope'" in _400(resolve_tool_choice, {"type": "function", "function": {"name": "nope"}}, tools, False, None)
    assert "needs tools" in _400(resolve_tool_choice, "required", [], False, None)


def test_required_schema_accepts_calls_and_refuses_others() -> None:
    tools = validate_tools(TOOLS)
    schema = tool_choice_schema("required", tools, None, True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "noop", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema("required", tools, None, False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "noop", "parameters": {}}] * 2, single)
    assert tool_choice_schema("named", tools, "get_weather", True) == P
    assert tool_choice_schema("auto", tools, None, True) is None


class _Tok:
    def get_vocab(self) -> dict[str, int]:
        return {}


def _stream(p: ChatReplyParser, text: str, cut: int):
    s = p.stream()
    out = [s.feed(text[:cut]), s.feed(text[cut:]), s.finish()]
    r = "".join(x[0] or "" for x in out) or None
    c = "".join(x[1] or "" for x in out) or None
    calls: dict[int, list[str]] = {}
    for _, _, ds in out:
        for d in ds:
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
    return r, c, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("mode,text,expected", [
    ("auto", '<think>hm</think>Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
             '<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
     ("hm", "Sure.", [("get_weather", '{"city": "Oslo"}'), ("noop", "{}")])),
    ("required", '<think>a</think>[{"name": "noop", "parameters": {}}]', ("a", None, [("noop", "{}")])),
    ("named", '{"city":  "Rome"}', (None, None, [("get_weather", '{"city":  "Rome"}')])),
    ("none", '<think>x</think><tool_call>', ("x", "<tool_call>", [])),
])
def test_reply_split_whole_and_streamed(mode: str, text: str, expected) -> None:
    tools = validate_tools(TOOLS)
    reasoner = get_reasoning_parser("qwen3")(_Tok())
    p = ChatReplyParser(mode, tools, "get_weather", get_tool_parser("hermes"), reasoner, False, True)
    r, c, calls = p.whole(text)
    assert (r, c, [(x.function.name, x.function.arguments) for x in calls]) == expected
    for cut in range(len(text) + 1):
        assert _stream(p, text, cut) == expected


def test_parallel_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "noop", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    p = ChatReplyParser("auto", validate_tools(TOOLS), None, get_tool_parser("hermes"), None, False, False)
    assert [c.function.name for c in p.whole(text)[2]] == ["noop"]
    assert _stream(p, text, 10)[2] == [("noop", "{}")]


SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
        "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_tools_and_history_as_text_for_a_template_without_tools() -> None:
    assert not template_uses_tools(SMOL)
    assert template_uses_tools("{% for tool in tools %}{{ tool | tojson }}{% endfor %}")
    conv = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out, extra = tool_conversation(conv, validate_tools(TOOLS), HermesToolParser(), SMOL)
    assert extra == {}
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "[c1] <tool_response>\nsunny\n</tool_response>"}
    # A template that takes tools gets them, and the history's arguments as objects.
    out, extra = tool_conversation([dict(m) for m in conv], TOOLS, HermesToolParser(), "{{ tools }}")
    assert extra == {"tools": TOOLS} and out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    # The default model's own template renders the rewritten conversation.
    from jinja2 import Template

    text = Template(SMOL).render(messages=tool_conversation(conv, validate_tools(TOOLS), HermesToolParser(), SMOL)[0],
                                 add_generation_prompt=True)
    assert text.count("<|im_start|>") == 5 and json.dumps(P) in text
