"""OpenAI's Responses API (/v1/responses) on a real `pagedllm serve` (the shared default-model
server: a small --responses-store-size), through the official `openai` SDK and raw HTTP.

Oracles independent of the translation layer: the greedy text of /v1/chat/completions and of
/v1/messages for the same conversation, the server's /tokenize of the conversation a chained
response continues, `jsonschema` for JSON replies and call arguments, the documented event order."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server_helpers import RESPONSES_STORE_SIZE as STORE
from server_helpers import Server, wait_idle

ASK = "Name three colors."
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


def events_of(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append(data)
    return out


def test_same_greedy_text_on_chat_responses_and_messages(client: openai.OpenAI, http: httpx.Client,
                                                          model: str) -> None:
    system = "You are terse."
    chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": ASK}])
    r = client.responses.create(model=model, instructions=system, input=ASK, max_output_tokens=16, temperature=0)
    m = http.post("/v1/messages", json={"model": model, "max_tokens": 16, "temperature": 0, "system": system,
                                        "messages": [{"role": "user", "content": ASK}]}).json()
    assert chat.choices[0].message.content == r.output_text == m["content"][0]["text"]
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens == m["usage"]["input_tokens"]
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_stream_event_order(client: openai.OpenAI, http: httpx.Client, model: str) -> None:
    body = {"model": model, "input": ASK, "max_output_tokens": 12, "temperature": 0}
    events = events_of(http, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = " ".join(e["type"] for e in events)
    assert re.fullmatch(r"response\.created response\.in_progress response\.output_item\.added "
                        r"response\.content_part\.added (response\.output_text\.delta )+response\.output_text\.done "
                        r"response\.content_part\.done response\.output_item\.done "
                        r"response\.(completed|incomplete)", kinds), kinds
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    whole = client.responses.create(**body)
    assert text == whole.output_text == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert events[-1]["response"]["usage"]["output_tokens"] == whole.usage.output_tokens
    # The SDK parses every event.
    streamed = client.responses.create(**body, stream=True)
    parsed = list(streamed)
    assert [e.type for e in parsed] == kinds.split()
    assert parsed[-1].response.output_text == whole.output_text


def test_previous_response_id_chains_and_unknown_ids_are_404(client: openai.OpenAI, http: httpx.Client,
                                                             model: str) -> None:
    first = client.responses.create(model=model, input="My name is Ana.", max_output_tokens=8, temperature=0,
                                    instructions="Be brief.", metadata={"k": "v"})
    assert first.metadata == {"k": "v"}
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # The chained prompt is the first turn (without its instructions), its reply, then the new input.
    conversation = [{"role": "user", "content": "My name is Ana."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    tokens = http.post("/tokenize", json={"messages": conversation}).json()["count"]
    assert second.usage.input_tokens == tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id="resp_unknown", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    # store=False keeps nothing; the store keeps the last STORE responses.
    unstored = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(STORE):
        client.responses.create(model=model, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="hi", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_text_format_json_schema(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=model, input="Describe a person as JSON.", max_output_tokens=64,
                                temperature=0, text={"format": fmt})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_function_call_round_trip(client: openai.OpenAI, http: httpx.Client, model: str) -> None:
    choice = {"type": "function", "name": "get_weather"}
    ask = "What is the weather in Paris?"
    r = client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice=choice, max_output_tokens=64,
                                temperature=0)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # Streamed: the arguments as deltas, the same call.
    events = events_of(http, {"model": model, "input": ask, "tools": [WEATHER], "tool_choice": choice,
                              "max_output_tokens": 64, "temperature": 0})
    kinds = " ".join(e["type"] for e in events)
    assert re.fullmatch(r"response\.created response\.in_progress response\.output_item\.added "
                        r"(response\.function_call_arguments\.delta )+response\.function_call_arguments\.done "
                        r"response\.output_item\.done response\.completed", kinds), kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == call.arguments
    # The output goes back with the call's result, by items and by previous_response_id.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    items = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), result]
    by_items = client.responses.create(model=model, input=items,  # type: ignore[arg-type]
                                       tools=[WEATHER], tool_choice="none", max_output_tokens=12, temperature=0)
    by_id = client.responses.create(model=model, input=[result], previous_response_id=r.id, tools=[WEATHER],
                                    tool_choice="none", max_output_tokens=12, temperature=0)
    assert by_items.output_text and by_items.output_text == by_id.output_text
    assert by_items.usage.input_tokens == by_id.usage.input_tokens


def test_bad_input_is_400_naming_it(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=model, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(model=model, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x"}]}])
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        client.responses.create(model=model, input="hi", reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]


def test_disconnect_mid_stream_aborts(http: httpx.Client, model: str) -> None:
    body = {"model": model, "input": ASK, "max_output_tokens": 600, "stream": True, "temperature": 1.0}
    with http.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break  # leaves mid-stream
    assert wait_idle(http)["pagedllm:num_requests_running"] == 0
    assert re.search(r'pagedllm:api_requests_total\{[^}]*endpoint="responses"[^}]*\} [1-9]', http.get("/metrics").text)
