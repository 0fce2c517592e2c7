"""The Responses API's request body and its translation into a chat completion request; the
response object and its output items built from a chat reply."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.chat_bridge import item_id

# reasoning.effort as a thinking budget in tokens (applied when the server has a reasoning parser).
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields are ignored (with a warning from the chat handler's log)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    user: str | None = None


def _part_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}]: unsupported content part type {kind!r} (supported: input_text, "
                              "output_text)", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: messages' text parts joined, function_call items as the
    assistant's tool calls, function_call_output items as tool messages, reasoning dropped."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            out.append({"role": role, "content": _part_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _part_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: unsupported input item type {kind!r} (supported: message, function_call, "
                              "function_call_output, reasoning)", "input")
    return out


def chat_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise bad_request(f"tools[{i}]: unsupported tool type {kind!r} (only function tools)", "tools")
            f = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            tools.append({"type": "function", "function": f})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(f"tool_choice must be auto, none, required or {{'type': 'function', 'name': ...}}, "
                              f"got {choice!r}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat API's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")


def thinking_budget(reasoning: dict[str, Any] | None) -> int | None:
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}", "reasoning")
    return EFFORT_BUDGETS[effort]


def chat_fields(body: ResponsesRequest, history: list[dict[str, Any]], reasoning: bool) -> dict[str, Any]:
    """The chat completion request for this Responses request, after the conversation `history`
    (a previous response's). `reasoning`: whether the server has a reasoning parser."""
    messages = list(history) + input_messages(body.input)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise bad_request("input must not be empty", "input")
    tools, choice = chat_tools(body)
    fields: dict[str, Any] = {"messages": messages, "stream": body.stream}
    budget = thinking_budget(body.reasoning)
    for key, value in (("model", body.model), ("max_tokens", body.max_output_tokens),
                       ("temperature", body.temperature), ("top_p", body.top_p), ("tools", tools),
                       ("tool_choice", choice), ("parallel_tool_calls", body.parallel_tool_calls),
                       ("response_format", response_format(body.text)), ("user", body.user),
                       ("thinking_token_budget", budget if reasoning else None)):
        if value is not None:
            fields[key] = value
    return fields


# ---- the response ----------------------------------------------------------------------------
def reasoning_item(text: str, status: str = "completed", iid: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"id": iid or item_id("rs"), "type": "reasoning", "summary": [], "content": content,
            "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed", iid: str | None = None) -> dict[str, Any]:
    return {"id": iid or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if text is not None else []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       iid: str | None = None) -> dict[str, Any]:
    return {"id": iid or item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat reply message as output items: reasoning, message, then function calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"], status))
    for call in message.get("tool_calls") or []:
        f = call.get("function") or {}
        items.append(function_call_item(call.get("id") or item_id("call"), f.get("name") or "",
                                        f.get("arguments") or ""))
    return items


def history_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a follow-up's conversation continues from."""
    return input_messages([item for item in output if item["type"] in ("message", "function_call")]) \
        if output else []


def usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def response_object(body: ResponsesRequest, resp_id: str, model: str, created: int, status: str,
                    output: list[dict[str, Any]], usage_obj: dict[str, Any] | None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict", False)} for t in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store, "temperature": body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": choice, "tools": tools, "top_p": body.top_p, "truncation": "disabled",
        "usage": usage_obj, "user": body.user,
    }


def now() -> int:
    return int(time.time())


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
