"""Tool calling and reasoning on /v1/chat/completions: the request's tools and tool_choice checked
(400 naming the tool or the flag), the structure that tool_choice "required" or a named tool
enforces, and one reply's text split into reasoning, content and tool calls, whole or streamed."""

from __future__ import annotations

import re
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import DeltaToolCall, ToolCall
from pagedllm.entrypoints.openai.tool_parsers.base import PartialCall, Scan, ToolCallStream, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_formats import JsonArrayToolParser
from pagedllm.reasoning import ReasoningParser

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def validate_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools, each checked: type "function", a valid name, parameters a JSON schema."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            got = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(f"tools[{i}]: type must be 'function', got {got!r}", "tools")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise bad_request(f"tools[{i}]: function must be an object", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad_request(f"tools[{i}]: tool name {name!r} must match {TOOL_NAME.pattern}", "tools")
        if name in names:
            raise bad_request(f"tools[{i}]: tool {name!r} is declared twice", "tools")
        names.add(name)
        params = f.get("parameters", EMPTY_PARAMETERS)
        if params is None:
            params = EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise bad_request(f"tool {name!r}: parameters must be a JSON schema object", "tools")
        try:
            validator_for(params).check_schema(params)
        except SchemaError as e:
            raise bad_request(f"tool {name!r}: parameters is not a valid JSON schema: {e.message}", "tools") from None
        out.append({**tool, "function": {**f, "parameters": params}})
    return out


def resolve_tool_choice(
    tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]], auto_enabled: bool, parser: str | None
) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named tool) as vLLM resolves it: with tools and
    no tool_choice, "auto"."""
    if not tools:
        if tool_choice in (None, "none"):
            return "none", None
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return "none", None
    if choice == "required":
        return "required", None
    if choice == "auto":
        if not (auto_enabled and parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"
            )
        return "auto", None
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(f"tool_choice must name a function as {{'type': 'function', 'function': {{'name': ...}}}}, "
                              f"got {choice!r}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
        return "named", name
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                      "tool_choice")


def tool_choice_schema(mode: str, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a reply must follow: "required", a non-empty array of calls of the tools;
    "named", that tool's parameters. None for the other modes."""
    if mode == "named":
        return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    if mode != "required":
        return None
    items = [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": t["function"]["parameters"]},
         "required": ["name", "parameters"]}
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolParser(ToolParser):
    """The reply a named tool_choice enforces: the whole text is that tool's arguments."""

    name = "named"

    def __init__(self, tool: str) -> None:
        super().__init__()
        self.tool = tool

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [PartialCall(self.tool, text if final else None, text)])


class ChatReplyParser:
    """How this request's replies split: reasoning (with a reasoning parser), then the answer's
    content and tool calls (by the mode's parser)."""

    def __init__(self, mode: str, tools: list[dict[str, Any]], name: str | None, auto_parser: type[ToolParser] | None,
                 reasoner: ReasoningParser | None, in_reasoning: bool, parallel: bool) -> None:
        self.reasoner = reasoner
        self.in_reasoning = in_reasoning
        self.max_calls = None if parallel else 1
        self.tools: ToolParser | None = None
        if mode == "named":
            self.tools = NamedToolParser(name or "")
        elif mode == "required":
            self.tools = JsonArrayToolParser(tools)
        elif mode == "auto" and auto_parser is not None:
            self.tools = auto_parser(tools)

    @property
    def active(self) -> bool:
        return self.reasoner is not None or self.tools is not None

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a whole reply."""
        reasoning, answer = None, text
        if self.reasoner is not None:
            reasoning, answer = self.reasoner.extract_reasoning(text, self.in_reasoning)
            answer = answer or ""
        if self.tools is None:
            return reasoning, answer or None, []
        content, calls = self.tools.extract_tool_calls(answer)
        if self.max_calls is not None:
            calls = calls[: self.max_calls]
        return reasoning, content, calls

    def stream(self) -> ChatReplyStream:
        return ChatReplyStream(self)


class ChatReplyStream:
    """One choice's deltas -> (reasoning delta, content delta, tool call deltas)."""

    def __init__(self, p: ChatReplyParser) -> None:
        self.reasoning = p.reasoner.streaming(p.in_reasoning) if p.reasoner is not None else None
        self.tools: ToolCallStream | None = p.tools.streaming(p.max_calls) if p.tools is not None else None

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.calls_sent > 0

    def feed(self, delta: str) -> tuple[str | None, str | None, list[DeltaToolCall]]:
        return self.step(delta, False)

    def finish(self) -> tuple[str | None, str | None, list[DeltaToolCall]]:
        return self.step("", True)

    def step(self, delta: str, final: bool) -> tuple[str | None, str | None, list[DeltaToolCall]]:
        reasoning, answer = None, delta
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.feed(delta)
            if final:
                r2, a2 = self.reasoning.finish()
                reasoning = ((reasoning or "") + (r2 or "")) or None
                answer = ((answer or "") + (a2 or "")) or None
        if self.tools is None:
            return reasoning, answer or None, []
        content, calls = self.tools.feed(answer) if answer else (None, [])
        if final:
            c2, calls2 = self.tools.finish()
            content = ((content or "") + (c2 or "")) or None
            calls = _merge(calls + calls2)
        return reasoning, content, calls


def _merge(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """Consecutive deltas of one call as one."""
    out: list[DeltaToolCall] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None and out[-1].function is not None and d.function is not None:
            f = out[-1].function
            f.arguments = (f.arguments or "") + (d.function.arguments or "")
        else:
            out.append(d)
    return out
