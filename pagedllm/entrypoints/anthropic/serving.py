"""POST /v1/messages and /v1/messages/count_tokens: the request translated into a chat completion
request (protocol.py), run by the chat handler, and its answer or chunks translated back into a
message or the Messages API's stream events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.anthropic.protocol import (
    MessagesRequest,
    chat_fields,
    error_body,
    error_response,
    parse_request,
)
from pagedllm.entrypoints.openai.chat_bridge import chat_request, item_id, render_prompt_tokens, run_chat
from pagedllm.entrypoints.openai.errors import bad_request, to_openai_error
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming import EngineStreamingResponse

PING_INTERVAL_S = 10.0


def stop_reason(finish: str | None, matched: Any, stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and the stop it matched."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return ("end_turn", None) if finish is not None else (None, None)


def tool_input(arguments: str | None) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply message as content blocks: thinking, text, then tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        f = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": call.get("id") or item_id("toolu"), "name": f.get("name"),
                       "input": tool_input(f.get("arguments"))})
    return blocks


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessagesServing:
    """The Messages API on top of the chat handler."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def fields(self, body: MessagesRequest) -> dict[str, Any]:
        return chat_fields(body, self.chat.reasoner is not None)

    async def count_tokens(self, raw: Any) -> Response:
        body = parse_request(raw)
        fields = self.fields(body)
        fields.pop("stream", None)
        req = chat_request(fields)
        self.chat.model_name(req.model)
        n = await self.chat.run_blocking(lambda: render_prompt_tokens(self.chat, req), 0)
        return JSONResponse({"input_tokens": n})

    async def create(self, raw: Any, raw_request: Request | None) -> Response:
        body = parse_request(raw)
        if body.max_tokens is None:
            raise bad_request("max_tokens: Field required", "max_tokens")
        fields = self.fields(body)
        model = self.chat.model_name(body.model)
        msg_id = item_id("msg")
        result = await run_chat(self.chat, fields, raw_request)
        if result.raw is not None:
            return result.raw
        if result.chunks is not None:
            return EngineStreamingResponse(self._stream(result.chunks, msg_id, model, body.stop_sequences))
        assert result.body is not None
        choice = result.body["choices"][0]
        reason, seq = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), body.stop_sequences)
        usage = result.body.get("usage") or {}
        message = {
            "id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(choice["message"]), "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)},
        }
        return JSONResponse(message)

    async def _stream(self, chunks: AsyncIterator[dict[str, Any]], msg_id: str, model: str,
                      stop_sequences: list[str] | None) -> AsyncIterator[str]:
        """message_start, ping, then per block content_block_start / _delta... / _stop (a new block
        whenever the reply turns from thinking to text to a tool call), message_delta (stop_reason,
        usage), message_stop. An engine error mid-stream is an `error` event."""
        started = False
        block: tuple[str, int] | None = None  # (kind, the chat tool call index) of the open block
        index = -1
        output_tokens = 0
        reason: tuple[str | None, str | None] = (None, None)
        last_ping = time.monotonic()

        def open_block(kind: str, key: int, start: dict[str, Any]) -> list[str]:
            nonlocal block, index
            out = close_block()
            index += 1
            block = (kind, key)
            out.append(event("content_block_start", {"index": index, "content_block": start}))
            return out

        def close_block() -> list[str]:
            nonlocal block
            if block is None:
                return []
            block = None
            return [event("content_block_stop", {"index": index})]

        try:
            async for chunk in chunks:
                if "error" in chunk:
                    err = chunk["error"] or {}
                    status = {"rate_limit_error": 429}.get(err.get("type"), 500)
                    yield event("error", {"error": error_body(status, str(err.get("message")))["error"]})
                    return
                usage = chunk.get("usage") or {}
                if not started:
                    started = True
                    yield event("message_start", {"message": {
                        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}})
                    yield event("ping", {})
                output_tokens = usage.get("completion_tokens", output_tokens)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        if block is None or block[0] != "thinking":
                            for s in open_block("thinking", -1, {"type": "thinking", "thinking": "", "signature": ""}):
                                yield s
                        yield event("content_block_delta", {"index": index, "delta": {
                            "type": "thinking_delta", "thinking": delta["reasoning_content"]}})
                    if delta.get("content"):
                        if block is None or block[0] != "text":
                            for s in open_block("text", -1, {"type": "text", "text": ""}):
                                yield s
                        yield event("content_block_delta", {"index": index, "delta": {
                            "type": "text_delta", "text": delta["content"]}})
                    for call in delta.get("tool_calls") or []:
                        f = call.get("function") or {}
                        if block is None or block != ("tool_use", call.get("index", 0)):
                            start = {"type": "tool_use", "id": call.get("id") or item_id("toolu"),
                                     "name": f.get("name") or "", "input": {}}
                            for s in open_block("tool_use", call.get("index", 0), start):
                                yield s
                        if f.get("arguments"):
                            yield event("content_block_delta", {"index": index, "delta": {
                                "type": "input_json_delta", "partial_json": f["arguments"]}})
                    if choice.get("finish_reason") is not None:
                        reason = stop_reason(choice["finish_reason"], choice.get("stop_reason"), stop_sequences)
                if time.monotonic() - last_ping > PING_INTERVAL_S:
                    last_ping = time.monotonic()
                    yield event("ping", {})
            for s in close_block():
                yield s
            yield event("message_delta", {"delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                                          "usage": {"output_tokens": output_tokens}})
            yield event("message_stop", {})
        except Exception as e:
            err = to_openai_error(e)
            yield event("error", {"error": error_body(err.status, err.message)["error"]})
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat, count: Callable[[str], None] | None = None) -> None:
    """POST /v1/messages and /v1/messages/count_tokens on `app`, every error in Anthropic's shape.
    `count(endpoint)` is called once per request (the endpoint label of the request metrics)."""
    serving = MessagesServing(chat)

    async def answer(raw_request: Request, run: Callable[[Any], Any]) -> Response:
        try:
            try:
                raw = await raw_request.json()
            except ValueError as e:
                raise bad_request(f"malformed JSON body: {e}") from None
            return await run(raw)
        except Exception as e:
            return error_response(to_openai_error(e))

    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        if count is not None:
            count("messages")
        return await answer(raw_request, lambda raw: serving.create(raw, raw_request))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw_request: Request) -> Response:
        return await answer(raw_request, serving.count_tokens)
