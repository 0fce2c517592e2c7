"""Tool calling and reasoning on /v1/chat/completions, end to end: one `pagedllm serve` of the
default model with `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`,
driven with the openai client and langchain-openai. Arguments are checked with jsonschema against
the tool's parameters; replies of a given shape are forced with `structured_outputs` regexes."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from server_helpers import Server, assert_error_shape, serve

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with serve(tmp_path_factory.mktemp("tools-server"), "--kv-cache-memory", "256MiB", "--dtype", "float32",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3") as s:
        yield s


def _check_calls(calls, names=None) -> list[tuple[str, dict]]:
    assert calls
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        assert names is None or c.function.name in names
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=8)
    m = r.choices[0].message
    assert not m.tool_calls and m.content and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("parallel", [pytest.param(True, marks=pytest.mark.slow), False])
def test_tool_choice_required(client: openai.OpenAI, parallel: bool) -> None:
    r = client.chat.completions.create(model="", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=parallel, max_tokens=MAX, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None
    calls = _check_calls(c.message.tool_calls, SCHEMAS)
    if not parallel:
        assert len(calls) == 1


def test_named_tool_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="", messages=MSGS, tools=TOOLS, max_tokens=MAX,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [n for n, _ in _check_calls(c.message.tool_calls)] == ["get_time"]


def _reassemble(stream) -> tuple[str | None, list[tuple[str, str]], str | None, str | None]:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reasoning or None, finish


@pytest.mark.parametrize("choice", [pytest.param("required", marks=pytest.mark.slow),
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_whole_ones(client: openai.OpenAI, choice) -> None:
    kw = dict(model="", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=MAX, seed=11, temperature=1.0)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, _, finish = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" == whole.finish_reason
    assert content is None
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


HERMES_REPLY = r'Let me look\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}</tool_call>'


def test_auto_parses_a_hermes_reply(client: openai.OpenAI) -> None:
    kw = dict(model="", messages=MSGS, tools=TOOLS, max_tokens=MAX, seed=5,
              extra_body={"structured_outputs": {"regex": HERMES_REPLY}})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == "Let me look."
    [(name, args)] = _check_calls(c.message.tool_calls)
    assert name == "get_weather" and args["unit"] == "celsius"
    content, calls, _, finish = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert calls == [(x.function.name, x.function.arguments) for x in c.message.tool_calls]


THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,20}"


def test_reasoning_content_split(client: openai.OpenAI) -> None:
    kw = dict(model="", messages=MSGS, max_tokens=MAX, seed=2, extra_body={"structured_outputs": {"regex": THINK}})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    raw = f"<think>{m.reasoning_content}</think>{m.content}"
    assert m.reasoning_content and m.content and m.model_extra["reasoning"] == m.reasoning_content
    assert re.fullmatch(THINK, raw)
    content, _, reasoning, _ = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert (reasoning, content) == (m.reasoning_content, m.content)
    # Thinking turned off: the same reply is all content.
    off = client.chat.completions.create(
        model="", messages=MSGS, max_tokens=MAX, seed=2,
        extra_body={"structured_outputs": {"regex": THINK}, "chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0].message
    assert off.reasoning_content is None and off.content == raw


def test_tool_history_renders(client: openai.OpenAI) -> None:
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(model="", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "'bad'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "'has space'"),
    ({"tools": [{"type": "retrieval"}]}, "'function'"),
    ({"tool_choice": "sometimes"}, "sometimes"),
])
def test_bad_tools_are_400_naming_the_problem(server: Server, body: dict, needle: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": MSGS, "tools": TOOLS, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert_error_shape(r.json())
    assert needle in r.json()["error"]["message"]


class Weather(BaseModel):
    city: str
    degrees: int


def test_langchain_bind_tools_and_structured_output(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2-135m-instruct", max_tokens=MAX,
                     temperature=0, max_retries=0)
    msg = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Rome?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)
    out = llm.with_structured_output(Weather).invoke("Give the weather in Oslo as JSON.")
    assert isinstance(out, Weather)
