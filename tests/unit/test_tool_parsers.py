"""Tool parsers against recorded replies of each format (one call, several, text before a call,
malformed -> content), and their streams fed the same text cut at every boundary and at random
chunkings: the same content, names and arguments as the whole-reply parse."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import JsonArrayToolParser, get_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}, "where": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}},
]
W = ("get_weather", {"city": "Paris \"Île\" \\ ✓", "days": 3})
F = ("f", {"x": 1.5})

# (parser, reply, expected content, expected [(name, arguments object)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Île\\" \\\\ \\u2713", "days": 3}}\n</tool_call>', None, [W]),
    ("hermes", 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris \\"Île\\" \\\\ ✓", "days": 3}}</tool_call>\n<tool_call>{"name": "f", "arguments": {"x": 1.5}}</tool_call>', "Let me check.\n", [W, F]),
    ("hermes", 'plain answer with < and <tool', "plain answer with < and <tool", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1.5</tool_call>', '<tool_call>{"name": "f", "arguments": {"x": 1.5</tool_call>', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris \\"Île\\" \\\\ ✓", "days": 3}}', None, [W]),
    ("llama3_json", 'Sure: {"name": "get_weather", "parameters": {"city": "Paris \\"Île\\" \\\\ ✓", "days": 3}}; {"name": "f", "parameters": {"x": 1.5}}', "Sure: ", [W, F]),
    ("llama3_json", '{"name": "f", "parameters": {"x": }', '{"name": "f", "parameters": {"x": }', []),
    ("llama3_json", 'a {"b": 1}', 'a {"b": 1}', []),
    ("llama3_json", 'He is {"name": "Bob", "age": 3}', 'He is {"name": "Bob", "age": 3}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris \\"Île\\" \\\\ ✓", "days": 3}}, {"name": "f", "arguments": {"x": 1.5}}]', None, [W, F]),
    ("mistral", 'Calling.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \\"Île\\" \\\\ ✓", "days": 3}[TOOL_CALLS]f[ARGS]{"x": 1.5}', "Calling.", [W, F]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1.5}', '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1.5}', []),
    ("qwen3_xml", 'I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis "Île" \\ ✓\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>', "I will look.\n", [W]),
    ("qwen3_xml", '<tool_call>\n<function=get_weather>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=where>\n{"lat": 1, "lon": [2, 3]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=f>\n<parameter=x>\n1.5\n</parameter>\n</function>\n</tool_call>',
     None, [("get_weather", {"metric": True, "where": {"lat": 1, "lon": [2, 3]}}), F]),
    ("qwen3_xml", 'no calls <tool', "no calls <tool", []),
    ("pythonic", '[get_weather(city="Paris \\"Île\\" \\\\ ✓", days=3), f(x=1.5)]', None, [W, F]),
    ("pythonic", 'Here: [get_weather(city=\'Paris "Île" \\\\ ✓\', days=3)]', "Here: ", [W]),
    ("pythonic", '[get_weather(city="Paris", days=)]', '[get_weather(city="Paris", days=)]', []),
    ("pythonic", 'the list [1, 2]', "the list [1, 2]", []),
]


def _whole(name: str, reply: str):
    parser = get_tool_parser(name)(TOOLS) if name != "json_array" else JsonArrayToolParser(TOOLS)
    content, calls = parser.extract_tool_calls(reply)
    return parser, content, [(c.function.name, c.function.arguments) for c in calls], calls


def _stream(parser, pieces: list[str]):
    s = parser.streaming()
    content, calls, ids = [], {}, {}
    for piece in pieces + [None]:
        c, deltas = s.feed(piece) if piece is not None else s.finish()
        if c is not None:
            assert c != ""
            content.append(c)
        for d in deltas:
            if d.index not in calls:
                assert d.index == len(calls) and d.id.startswith("chatcmpl-tool-") and d.type == "function"
                calls[d.index] = [d.function.name, ""]
                ids[d.index] = d.id
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
    return "".join(content) or None, [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("name,reply,content,expected", CASES)
def test_whole_reply(name, reply, content, expected) -> None:
    _, got_content, got, calls = _whole(name, reply)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got] == expected
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)


@pytest.mark.parametrize("name,reply,content,expected", CASES)
def test_stream_at_every_boundary_and_random_chunks(name, reply, content, expected) -> None:
    parser, whole_content, whole_calls, _ = _whole(name, reply)
    want = (whole_content, whole_calls)
    if whole_calls:  # a malformed reply's stream may have named a call before it broke
        assert _stream(parser, list(reply)) == want
        for i in range(len(reply) + 1):
            assert _stream(parser, [reply[:i], reply[i:]]) == want, i
        rng = random.Random(1)
        for _ in range(100):
            cuts = sorted(rng.sample(range(len(reply) + 1), rng.randint(1, 8)))
            pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
            assert _stream(parser, pieces) == want
    else:
        got_content, _ = _stream(parser, list(reply))
        assert got_content == whole_content


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_xml"])
def test_arguments_stream_in_several_fragments(name) -> None:
    reply = next(r for n, r, _, e in CASES if n == name and e)
    s = get_tool_parser(name)(TOOLS).streaming()
    fragments = [d.function.arguments for ch in reply for d in s.feed(ch)[1] if d.function.arguments]
    assert len(fragments) > 3


def test_required_choice_array() -> None:
    reply = '[{"name": "get_weather", "parameters": {"city": "Paris \\"Île\\" \\\\ ✓", "days": 3}}, {"name": "f", "parameters": {"x": 1.5}}]'
    parser, content, calls, _ = _whole("json_array", reply)
    assert content is None and [(n, json.loads(a)) for n, a in calls] == [W, F]
    for i in range(len(reply) + 1):
        assert _stream(parser, [reply[:i], reply[i:]]) == (None, calls)
    assert _whole("json_array", '[{"name": "f"')[2] == []


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'nope'.*hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_xml", "pythonic"])
def test_format_calls_parses_back(name) -> None:
    parser = get_tool_parser(name)(TOOLS)
    text = parser.format_calls([("get_weather", {"city": "Paris", "days": 3}), ("f", {"x": 1.5})])
    _, calls = parser.extract_tool_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("f", {"x": 1.5})]
