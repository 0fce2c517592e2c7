"""Running a translated request through /v1/chat/completions' own handler, for the endpoints that
are translation layers over it (/v1/messages, /v1/responses): the same chat template, sampling,
structured outputs, tool-call and reasoning parsers, engine call and disconnect handling. The
chat answer comes back as its JSON object, or as the stream of its chunk objects."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming import EngineStreamingResponse
from pagedllm.entrypoints.openai.tool_parsers.chat import validate_tools


@dataclass
class ChatResult:
    """What the chat handler answered: its JSON object (`body`), its chunk objects (`chunks`, a
    stream that ends the engine request when closed), or a bare response to pass on (`raw`, e.g.
    499 for a client that left before the first token)."""

    body: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    raw: Response | None = None


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A ChatCompletionRequest from translated fields (a bad one is a 400 naming the problem)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as e:
        raise bad_request(f"invalid request: {e}") from None


async def run_chat(chat: OpenAIServingChat, fields: dict[str, Any], raw_request: Request | None) -> ChatResult:
    """Runs the chat request `fields` through the chat handler. A stream asks for the usage on every
    chunk (so the prompt's token count is known from the first chunk) and once more at the end."""
    if fields.get("stream"):
        fields = {**fields, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    resp = await chat.create_chat_completion(chat_request(fields), raw_request)
    if isinstance(resp, EngineStreamingResponse):
        return ChatResult(chunks=_chunks(resp))
    if resp.status_code != 200 or resp.media_type != "application/json":
        return ChatResult(raw=resp)
    return ChatResult(body=json.loads(bytes(resp.body)))


async def _chunks(resp: EngineStreamingResponse) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's objects (an error mid-stream is an object with an "error" key); closing
    this closes the chat stream, which aborts the engine request."""
    it = resp.body_iterator
    try:
        async for event in it:
            text = event if isinstance(event, str) else bytes(event).decode()
            for line in text.splitlines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                yield json.loads(data)
    finally:
        await it.aclose()  # type: ignore[attr-defined]


def render_prompt_tokens(chat: OpenAIServingChat, body: ChatCompletionRequest) -> int:
    """How many tokens the conversation (with its tools) is through the chat template."""
    tools = validate_tools(body.tools)
    tool_format = chat._tool_format(tools, body.messages)
    prompt = chat.render_chat(body.messages, True, False, body.chat_template_kwargs, tools=tools,
                              tool_format=tool_format)
    return len(prompt.token_ids)




def item_id(prefix: str) -> str:
    """An id as Anthropic's and OpenAI's newer APIs write them: msg_..., resp_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"
