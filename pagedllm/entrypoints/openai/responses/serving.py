"""POST /v1/responses and GET /v1/responses/{id}: the request translated into a chat completion
request (protocol.py), run by the chat handler, its answer or chunks translated back into a
response object or the Responses API's typed stream events; responses kept in a bounded
least-recently-used store for previous_response_id."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.chat_bridge import item_id, run_chat
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_response, to_openai_error
from pagedllm.entrypoints.openai.responses.protocol import (
    ResponsesRequest,
    chat_fields,
    dumps,
    function_call_item,
    history_of,
    message_item,
    now,
    output_items,
    reasoning_item,
    response_object,
    text_part,
    usage,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.streaming import EngineStreamingResponse


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]
    """The conversation (without instructions) through this response's output."""


class ResponseStore:
    """The last `size` stored responses, the least recently used evicted first."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"--responses-store-size must be non-negative, got {size}")
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, resp_id: str, item: Stored) -> None:
        if self.size == 0:
            return
        self._items[resp_id] = item
        self._items.move_to_end(resp_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, resp_id: str, param: str | None = None) -> Stored:
        item = self._items.get(resp_id)
        if item is None:
            raise OpenAIError(404, f"Response with id {resp_id!r} not found (never stored, or evicted from the "
                              f"server's last {self.size} responses, --responses-store-size)",
                              type="invalid_request_error", param=param, code="response_not_found")
        self._items.move_to_end(resp_id)
        return item


class ResponsesServing:
    def __init__(self, chat: OpenAIServingChat, store_size: int) -> None:
        self.chat = chat
        self.store = ResponseStore(store_size)

    def reasoning_tokens(self, output: list[dict[str, Any]], completion_tokens: int) -> int:
        """The output's reasoning tokens: all of them when the output is reasoning only, else the
        reasoning text re-tokenized (at most the output's tokens)."""
        texts = [c["text"] for o in output if o["type"] == "reasoning" for c in o.get("content") or []]
        if not texts:
            return 0
        if all(o["type"] == "reasoning" for o in output):
            return completion_tokens
        n = len(self.chat.tokenizer.encode("".join(texts), add_special_tokens=False))
        return min(n, completion_tokens)

    async def create(self, raw: Any, raw_request: Request | None) -> Response:
        if not isinstance(raw, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            body = ResponsesRequest.model_validate(raw)
        except ValueError as e:
            first = e.errors()[0] if hasattr(e, "errors") else {}
            where = ".".join(str(x) for x in first.get("loc", ())) or "body"
            raise bad_request(f"invalid request: {where}: {first.get('msg', e)}", where.split(".")[0]) from None
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id, "previous_response_id").messages
        fields = chat_fields(body, history, self.chat.reasoner is not None)
        model = self.chat.model_name(body.model)
        resp_id = item_id("resp")
        created = now()
        result = await run_chat(self.chat, fields, raw_request)
        if result.raw is not None:
            return result.raw
        conversation = [m for m in fields["messages"] if not (body.instructions and m is fields["messages"][0])]
        if result.chunks is not None:
            events = self._stream(result.chunks, body, resp_id, model, created, conversation)
            return EngineStreamingResponse(events)
        assert result.body is not None
        choice = result.body["choices"][0]
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        output = output_items(choice["message"], status)
        u = result.body.get("usage") or {}
        reasoning = self.reasoning_tokens(output, u.get("completion_tokens", 0))
        usage_obj = usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                          (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), reasoning)
        obj = response_object(body, resp_id, model, created, status, output, usage_obj)
        self._keep(body, obj, conversation)
        return Response(dumps(obj), media_type="application/json")

    def _keep(self, body: ResponsesRequest, obj: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if body.store:
            self.store.put(obj["id"], Stored(obj, conversation + history_of(obj["output"])))

    async def _stream(self, chunks: AsyncIterator[dict[str, Any]], body: ResponsesRequest, resp_id: str,
                      model: str, created: int, conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        """response.created, response.in_progress; per output item output_item.added, its content
        part or arguments as deltas, their .done events, output_item.done (a new item whenever the
        reply turns from reasoning to text to a call); then response.completed, or
        response.incomplete (max_output_tokens) or response.failed (an engine error)."""
        seq = 0
        output: list[dict[str, Any]] = []
        item: dict[str, Any] | None = None  # the open item; its text or arguments so far in `buf`
        buf: list[str] = []
        call_index: int | None = None
        finish: str | None = None
        u: dict[str, Any] = {}

        def ev(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        def snapshot(status: str, usage_obj: dict[str, Any] | None = None,
                     error: dict[str, Any] | None = None) -> dict[str, Any]:
            return response_object(body, resp_id, model, created, status, list(output), usage_obj, error)

        def open_item(new: dict[str, Any]) -> list[str]:
            nonlocal item, buf
            out = close_item()
            item, buf = new, []
            at = len(output)
            out.append(ev("response.output_item.added", output_index=at, item=new))
            if new["type"] == "message":
                out.append(ev("response.content_part.added", item_id=new["id"], output_index=at, content_index=0,
                              part=text_part("")))
            elif new["type"] == "reasoning":
                out.append(ev("response.content_part.added", item_id=new["id"], output_index=at, content_index=0,
                              part={"type": "reasoning_text", "text": ""}))
            return out

        def close_item(status: str = "completed") -> list[str]:
            nonlocal item
            if item is None:
                return []
            at, text, iid = len(output), "".join(buf), item["id"]
            ids = {"item_id": iid, "output_index": at}
            out = []
            if item["type"] == "message":
                done = message_item(text, status, iid)
                out.append(ev("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]))
                out.append(ev("response.content_part.done", **ids, content_index=0, part=text_part(text)))
            elif item["type"] == "reasoning":
                done = reasoning_item(text, "completed", iid)
                out.append(ev("response.reasoning_text.done", **ids, content_index=0, text=text))
                out.append(ev("response.content_part.done", **ids, content_index=0,
                              part={"type": "reasoning_text", "text": text}))
            else:
                done = function_call_item(item["call_id"], item["name"], text, "completed", iid)
                out.append(ev("response.function_call_arguments.done", **ids, arguments=text, name=item["name"]))
            out.append(ev("response.output_item.done", output_index=at, item=done))
            output.append(done)
            item = None
            return out

        def delta(kind: str, text: str) -> str:
            assert item is not None
            buf.append(text)
            ids = {"item_id": item["id"], "output_index": len(output)}
            if kind == "message":
                return ev("response.output_text.delta", **ids, content_index=0, delta=text, logprobs=[])
            if kind == "reasoning":
                return ev("response.reasoning_text.delta", **ids, content_index=0, delta=text)
            return ev("response.function_call_arguments.delta", **ids, delta=text)

        try:
            yield ev("response.created", response=snapshot("in_progress"))
            yield ev("response.in_progress", response=snapshot("in_progress"))
            async for chunk in chunks:
                if "error" in chunk:
                    for s in close_item("incomplete"):
                        yield s
                    err = chunk["error"] or {}
                    error = {"code": err.get("code") or "server_error", "message": str(err.get("message"))}
                    yield ev("response.failed", response=snapshot("failed", None, error))
                    return
                u = chunk.get("usage") or u
                for choice in chunk.get("choices") or []:
                    d = choice.get("delta") or {}
                    if d.get("reasoning_content"):
                        if item is None or item["type"] != "reasoning":
                            for s in open_item(reasoning_item("", "in_progress")):
                                yield s
                        yield delta("reasoning", d["reasoning_content"])
                    if d.get("content"):
                        if item is None or item["type"] != "message":
                            for s in open_item(message_item(None, "in_progress")):
                                yield s
                        yield delta("message", d["content"])
                    for call in d.get("tool_calls") or []:
                        f = call.get("function") or {}
                        if item is None or item["type"] != "function_call" or call.get("index", 0) != call_index:
                            call_index = call.get("index", 0)
                            new = function_call_item(call.get("id") or item_id("call"), f.get("name") or "", "",
                                                     "in_progress")
                            for s in open_item(new):
                                yield s
                        if f.get("arguments"):
                            yield delta("function_call", f["arguments"])
                    if choice.get("finish_reason") is not None:
                        finish = choice["finish_reason"]
            status = "incomplete" if finish == "length" else "completed"
            for s in close_item(status):
                yield s
            reasoning = self.reasoning_tokens(output, u.get("completion_tokens", 0))
            usage_obj = usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                              (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), reasoning)
            final = snapshot(status, usage_obj)
            self._keep(body, final, conversation)
            yield ev("response.completed" if status == "completed" else "response.incomplete", response=final)
        except Exception as e:
            err = to_openai_error(e)
            yield ev("response.failed", response=snapshot("failed", None, {"code": err.code or "server_error",
                                                                             "message": err.message}))
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    def retrieve(self, resp_id: str) -> Response:
        return Response(dumps(self.store.get(resp_id).response), media_type="application/json")


def add_responses_routes(app: FastAPI, chat: OpenAIServingChat, store_size: int,
                         count: Callable[[str], None] | None = None) -> None:
    """POST /v1/responses and GET /v1/responses/{id} on `app`, every error in OpenAI's shape.
    `count(endpoint)` is called once per request (the endpoint label of the request metrics)."""
    serving = ResponsesServing(chat, store_size)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        if count is not None:
            count("responses")
        try:
            try:
                raw = await raw_request.json()
            except ValueError as e:
                raise bad_request(f"malformed JSON body: {e}") from None
            return await serving.create(raw, raw_request)
        except Exception as e:
            return error_response(to_openai_error(e))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        try:
            return serving.retrieve(response_id)
        except Exception as e:
            return error_response(to_openai_error(e))
