"""Tools in the prompt. A chat template that reads `tools` gets them as transformers passes them
(and history tool calls with their arguments as objects). A template that does not (SmolLM2's)
gets the tool list in the system message, with the call format of the active parser, and the
history in text:

- an assistant message's `tool_calls` are appended to its content in the parser's format
  (hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`);
- a `tool` message becomes a user message `<tool_response>\\n{content}\\n</tool_response>`
  (preceded by `[call id]` when it names one)."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser, dumps

TOOLS_SYSTEM_PROMPT = (
    "You can call these tools; each is given by its JSON schema:\n<tools>\n{tools}\n</tools>\n\n"
    "To call tools, reply with the calls in this format, replacing the name and arguments:\n{example}"
)


def template_uses_tools(template: Any) -> bool:
    """Whether the chat template reads a `tools` variable."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for tc in message.get("tool_calls") or []:
        f = tc.get("function", {}) if isinstance(tc, dict) else {}
        out.append((str(f.get("name", "")), _arguments_object(f.get("arguments", {}))))
    return out


def tool_conversation(
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    parser: ToolParser,
    template: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the conversation to render, extra template arguments) for this request's tools."""
    if template_uses_tools(template):
        for m in conversation:
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**tc, "function": {**tc.get("function", {}),
                                        "arguments": _arguments_object(tc.get("function", {}).get("arguments", {}))}}
                    for tc in m["tool_calls"]
                ]
        return conversation, ({"tools": tools} if tools else {})
    out = []
    for m in conversation:
        m = dict(m)
        if m.get("tool_calls"):
            text = parser.format_calls(_calls(m))
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            del m["tool_calls"]
        if m["role"] == "tool":
            head = f"[{m['tool_call_id']}] " if m.get("tool_call_id") else ""
            m = {"role": "user", "content": f"{head}<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if tools:
        text = TOOLS_SYSTEM_PROMPT.format(
            tools="\n".join(dumps(t["function"]) for t in tools),
            example=parser.format_calls([("tool_name", {"argument": "value"})]),
        )
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0].get("content") else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}
