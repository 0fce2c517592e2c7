"""Anthropic's Messages API (/v1/messages) on a real `pagedllm serve` (the shared default-model
server, started with --api-key), through the official `anthropic` SDK and raw HTTP.

Oracles independent of the translation layer: the server's /tokenize of the same conversation
(count_tokens and usage), `jsonschema` for tool inputs, the greedy text of /v1/chat/completions,
the documented event sequence of a stream, the SDK's own error classes."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from server_helpers import API_KEY as KEY
from server_helpers import Server, wait_idle

GREEDY = {"temperature": 0}  # the SDK has no temperature argument: it goes in the body as is
HELLO = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                     "required": ["city"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def chat_text(http: httpx.Client, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(http: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed /v1/messages, checking the name matches data's type."""
    out = []
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                out.append((name, data))
    return out


def test_create_matches_chat_completions_and_counts_tokens(client: anthropic.Anthropic, http: httpx.Client,
                                                           model: str) -> None:
    system = "You are terse."
    m = client.messages.create(model=model, max_tokens=12, system=system, messages=HELLO, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == model
    [block] = m.content
    assert block.type == "text"
    chat = chat_text(http, [{"role": "system", "content": system}, *HELLO], 12)
    assert block.text == chat["choices"][0]["message"]["content"]
    want_stop = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert m.stop_reason == want_stop and m.stop_sequence is None
    tokens = http.post("/tokenize", json={"messages": [{"role": "system", "content": system}, *HELLO]}).json()
    assert m.usage.input_tokens == tokens["count"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    counted = client.messages.count_tokens(model=model, system=system, messages=HELLO)
    assert counted.input_tokens == tokens["count"]
    # System as text blocks is the same prompt.
    counted = client.messages.count_tokens(model=model, system=[{"type": "text", "text": system}], messages=HELLO)
    assert counted.input_tokens == tokens["count"]


def test_stop_sequence(client: anthropic.Anthropic, model: str) -> None:
    full = client.messages.create(model=model, max_tokens=16, messages=HELLO, extra_body=GREEDY).content[0].text
    words = re.findall(r"[A-Za-z]{3,}", full)
    assert len(words) >= 2, full
    stop = words[1]
    m = client.messages.create(model=model, max_tokens=16, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.index(stop)]


def test_stream_event_sequence_and_text(client: anthropic.Anthropic, http: httpx.Client, model: str) -> None:
    body = {"model": model, "max_tokens": 12, "messages": HELLO, "temperature": 0}
    events = sse_events(http, body)
    names = " ".join(n for n, _ in events)
    # The documented order: message_start, then blocks, message_delta, message_stop (pings anywhere).
    compact = re.sub(r"ping ?", "", names).strip()
    assert re.fullmatch(r"message_start (content_block_start (content_block_delta )*content_block_stop )+"
                        r"message_delta message_stop", compact), names
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    whole = client.messages.create(model=model, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    assert text == whole.content[0].text
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model=model, max_tokens=12, messages=HELLO, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    pytest.param({"type": "any"}, marks=pytest.mark.slow)])
def test_tool_use_round_trip(client: anthropic.Anthropic, model: str, choice: dict[str, Any]) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=model, max_tokens=256, messages=ask, tools=[WEATHER], tool_choice=choice,
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" for u in uses)
    for u in uses:
        jsonschema.validate(u.input, WEATHER["input_schema"])
    # The same request streamed: the same call, its input sent as input_json_delta fragments.
    with client.messages.stream(model=model, max_tokens=256, messages=ask, tools=[WEATHER], tool_choice=choice,
                                extra_body=GREEDY) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(kinds) == {"input_json_delta"}
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert final.stop_reason == "tool_use"
    # The result goes back as a tool_result block; the reply is text about it.
    follow = [*ask, {"role": "assistant", "content": m.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 21 C"}
                                           for u in uses]}]
    reply = client.messages.create(model=model, max_tokens=16, messages=follow, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "none"})
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
    n = client.messages.count_tokens(model=model, messages=follow, tools=[WEATHER]).input_tokens
    assert n == reply.usage.input_tokens
    assert n > client.messages.count_tokens(model=model, messages=ask, tools=[WEATHER]).input_tokens


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, server: Server, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body={"model": model, "messages": HELLO})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="'image_url'"):
        client.messages.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "url": "x"}]}])  # type: ignore[list-item]
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(model=model, max_tokens=4, messages=HELLO, tool_choice={"type": "tool", "name": "x"})
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="no-such-model", max_tokens=4, messages=HELLO)
    assert nf.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model=model, max_tokens=4, messages=HELLO)
    assert auth.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": auth.value.body["error"]["message"]}}
    # x-api-key and Authorization: Bearer both carry the key; neither is a 401.
    with httpx.Client(base_url=server.url, timeout=60) as raw:
        body = {"model": model, "max_tokens": 2, "messages": HELLO}
        assert raw.post("/v1/messages", json=body).status_code == 401
        assert raw.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
        assert raw.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert raw.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2},
                        headers={"x-api-key": KEY}).status_code == 200


def test_disconnect_mid_stream_aborts(server: Server, http: httpx.Client, model: str) -> None:
    body = {"model": model, "max_tokens": 600, "messages": HELLO, "stream": True, "temperature": 1.0}
    with http.stream("POST", "/v1/messages", json=body) as r:
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break  # leaves mid-stream
    after = wait_idle(http)
    assert after["pagedllm:num_requests_running"] == 0
    text = http.get("/metrics").text
    assert re.search(r'pagedllm:api_requests_total\{endpoint="messages",model_name="[^"]+"\} [1-9]', text) or \
        re.search(r'pagedllm:api_requests_total\{model_name="[^"]+",endpoint="messages"\} [1-9]', text), text
