"""Thinking on /v1/messages and /v1/responses: a tiny random Llama whose tokenizer has `<think>`
and `</think>` as single tokens, served with `--reasoning-parser deepseek_r1` (a reply starts
inside the thinking). Anthropic's thinking budget and the Responses API's reasoning effort become
the thinking token budget; the thinking comes back as thinking blocks and reasoning items, whole
and streamed. Oracle: /v1/chat/completions' reasoning_content and content for the same request."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from server_helpers import Server, serve

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: <think>{% endif %}")
ASK = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, thinker_model_dir: str):
    d = tmp_path_factory.mktemp("thinker-server")
    (d / "template.jinja").write_text(TEMPLATE)
    with serve(d, thinker_model_dir, "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256",
               "--reasoning-parser", "deepseek_r1", "--chat-template", str(d / "template.jinja")) as s:
        yield s


def chat(http: httpx.Client, model: str, budget: int, max_tokens: int) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": max_tokens,
                                                "temperature": 0, "thinking_token_budget": budget})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_thinking_blocks(server: Server, http: httpx.Client, model: str) -> None:
    want = chat(http, model, 3, 12)
    assert want["reasoning_content"] and want["content"], want
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = {"model": model, "max_tokens": 12, "messages": ASK, "extra_body": {"temperature": 0},
                              "thinking": {"type": "enabled", "budget_tokens": 3}}
    m = client.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == want["reasoning_content"] and m.content[1].text == want["content"]
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    assert deltas == sorted(deltas, key=lambda k: k != "thinking_delta")  # all thinking, then all text
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", want["reasoning_content"]), ("text", want["content"])]


def test_reasoning_items(server: Server, http: httpx.Client, model: str) -> None:
    want = chat(http, model, 256, 12)  # reasoning.effort "minimal" is a budget of 256 tokens
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = {"model": model, "input": ASK, "max_output_tokens": 12, "temperature": 0,
                              "reasoning": {"effort": "minimal"}}
    r = client.responses.create(**kwargs)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == want["reasoning_content"]
    assert r.status == "incomplete" and r.usage.output_tokens == 12
    assert r.usage.output_tokens_details.reasoning_tokens == 12  # the output is all thinking
    events = []
    with http.stream("POST", "/v1/responses", json={**kwargs, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == want["reasoning_content"]
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 12
