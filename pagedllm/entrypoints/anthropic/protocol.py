"""The Messages API's request body, its translation into a chat completion request, and
Anthropic's error shape {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request

# Anthropic's error type for each HTTP status (others: api_error).
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
    529: "overloaded_error",
}


class MessagesRequest(BaseModel):
    """POST /v1/messages (and /v1/messages/count_tokens, which has no max_tokens). Content blocks
    are read by `chat_fields`, which names an unknown block type; other unknown fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def parse_request(raw: Any) -> MessagesRequest:
    """The body as a MessagesRequest, or a 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return MessagesRequest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise bad_request(f"{where}: {first.get('msg', 'invalid value')}", where) from None


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (what a system prompt or a tool result holds)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{i}]: only text blocks are supported here, got type {kind!r}", where)
        texts.append(block["text"])
    return "\n".join(texts)


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: text blocks joined, tool_use blocks as the assistant's
    tool calls, tool_result blocks as tool messages (before the user's text of the same turn),
    earlier thinking dropped."""
    out: list[dict[str, Any]] = []
    system = _text(body.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    if not body.messages:
        raise bad_request("messages: at least one message is required", "messages")
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                "content": _text(block.get("content"), f"{at}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif kind in ("text", "tool_use", "tool_result"):
                raise bad_request(f"{at}: a {kind!r} block is not valid in a {role} message", "messages")
            else:
                raise bad_request(f"{at}: unsupported content block type {kind!r} (supported: text, tool_use, "
                                  "tool_result)", "messages")
        out.extend(results)
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_tools(body: MessagesRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) in the chat API's terms."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            kind = t.get("type", "custom") if isinstance(t, dict) else None
            if kind not in ("custom", None) or not isinstance(t, dict):
                raise bad_request(f"tools[{i}]: unsupported tool type {kind!r} (only custom tools with an "
                                  "input_schema)", "tools")
            f: dict[str, Any] = {"name": t.get("name"), "parameters": t.get("input_schema")}
            if t.get("description") is not None:
                f["description"] = t["description"]
            tools.append({"type": "function", "function": f})
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return tools, "auto" if tools else None, parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "none":
        return tools, "none", parallel
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")


def chat_fields(body: MessagesRequest, reasoning: bool) -> dict[str, Any]:
    """The chat completion request this Messages request is. `reasoning`: whether the server has a
    reasoning parser (a thinking budget becomes its thinking_token_budget)."""
    tools, tool_choice, parallel = chat_tools(body)
    fields: dict[str, Any] = {"messages": chat_messages(body), "stream": body.stream}
    for key, value in (("model", body.model), ("max_tokens", body.max_tokens), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("top_k", body.top_k), ("stop", body.stop_sequences),
                       ("tools", tools), ("tool_choice", tool_choice), ("parallel_tool_calls", parallel)):
        if value is not None:
            fields[key] = value
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str):
        fields["user"] = user
    thinking = body.thinking or {}
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 0:
            raise bad_request(f"thinking.budget_tokens must be a non-negative integer, got {budget!r}", "thinking")
        if reasoning:
            fields["thinking_token_budget"] = budget
    elif kind == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    elif kind is not None:
        raise bad_request(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", "thinking")
    return fields


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(err: OpenAIError) -> JSONResponse:
    """An OpenAIError in Anthropic's shape, with the same status and headers."""
    return JSONResponse(error_body(err.status, err.message), status_code=err.status, headers=err.headers)
