"""The tool parser interface: a whole reply -> (content, tool calls), and a per-request stream that
turns text deltas into `delta.tool_calls` whose argument fragments add up to the whole reply's
`arguments` exactly, whatever the chunk boundaries.

A parser implements one method, `scan(text, final)`: the content so far and the calls so far (a
call's name once it is complete; its arguments once complete, or else a prefix of them that is
certain). The whole-reply parse is the final scan; the stream diffs successive scans. A reply that
does not parse is plain content (never an error)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from pagedllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagedllm.reasoning.parsers import held_suffix


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def dumps(value: Any) -> str:
    """The one serialization of a call's arguments (streamed fragments add up to it)."""
    return json.dumps(value, ensure_ascii=False)


def open_prefix(value: Any) -> str:
    """A prefix of `dumps(final)` for every value `final` that a partially parsed `value` may grow
    into: the last scalar is held back (a number or literal may go on), a string stays open, and
    no container is closed."""
    if isinstance(value, dict):
        if not value:
            return "{"
        items = list(value.items())
        head = "".join(f"{dumps(k)}: {dumps(v)}, " for k, v in items[:-1])
        k, v = items[-1]
        return "{" + head + f"{dumps(k)}: " + open_prefix(v)
    if isinstance(value, list):
        if not value:
            return "["
        return "[" + "".join(f"{dumps(v)}, " for v in value[:-1]) + open_prefix(value[-1])
    if isinstance(value, str):
        if value and "\ud800" <= value[-1] <= "\udbff":
            value = value[:-1]  # half of a surrogate pair
        return dumps(value)[:-1]
    return ""


def try_partial(text: str, allow: Allow = Allow.ALL) -> Any:
    try:
        return partial_loads(text, allow)
    except Exception:
        return None


@dataclass
class PartialCall:
    name: str | None
    """The function's name, once complete (None: not yet known)."""
    arguments: str | None = None
    """The complete arguments (JSON text), or None while the call is open."""
    prefix: str = ""
    """While open: text the final arguments are certain to start with."""


@dataclass
class Scan:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def json_call(body: str, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters"),
              require_args: bool = False) -> PartialCall | None:
    """A call written as one JSON object {"name": ..., "arguments": {...}} (or under one of
    `args_keys`; missing arguments are {} unless `require_args`). final: None when it is not such
    an object."""
    if final:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if require_args and not (isinstance(obj, dict) and any(k in obj for k in args_keys)):
            return None
        return _call_from_obj(obj, args_keys)
    full = try_partial(body)
    names = try_partial(body, Allow.ALL & ~Allow.STR)
    if not isinstance(full, dict) or not isinstance(names, dict):
        return PartialCall(None)
    name = names.get("name")
    if not isinstance(name, str):
        return PartialCall(None)
    for key in args_keys:
        if key in full:
            args = full[key]
            return PartialCall(name, prefix=open_prefix(args) if isinstance(args, dict) else "")
    return PartialCall(name)


def _call_from_obj(obj: Any, args_keys: tuple[str, ...]) -> PartialCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # arguments sent as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return PartialCall(obj["name"], dumps(args))


def json_call_list(body: str, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[PartialCall] | None:
    """Calls written as a JSON array of call objects (a lone object counts as one). final: None
    when the text is not such an array."""
    if final:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_obj(o, args_keys) for o in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
    full = try_partial(body)
    names = try_partial(body, Allow.ALL & ~Allow.STR)
    if isinstance(full, dict):
        full, names = [full], [names]
    if not isinstance(full, list) or not isinstance(names, list):
        return []
    calls = []
    for i, item in enumerate(full):
        last = i == len(full) - 1
        if not last:
            c = _call_from_obj(item, args_keys)
            if c is None:
                break
            calls.append(c)
            continue
        named = names[i] if i < len(names) and isinstance(names[i], dict) else {}
        if not isinstance(item, dict) or not isinstance(named.get("name"), str):
            break
        args = next((item[k] for k in args_keys if k in item), None)
        calls.append(PartialCall(named["name"], prefix=open_prefix(args) if isinstance(args, dict) else ""))
    return calls


def content_before(text: str, final: bool, *markers: str) -> tuple[str, int]:
    """(content, index where the calls start or -1): the text before the first marker; while
    streaming, without a tail that may be the start of a marker."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        i = min(found)
        return text[:i], i
    if final:
        return text, -1
    k = max(held_suffix(text, m) for m in markers)
    return text[: len(text) - k], -1


class ToolParser:
    """One model family's tool-call format."""

    name = ""
    needs_special_tokens = False
    """The format's markers are special tokens: the reply is detokenized with them kept."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The calls (name, arguments) written in this format (for history and instructions)."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole reply."""
        s = self.scan(text, True)
        calls = [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name or "", arguments=c.arguments or "{}"))
            for c in s.calls
        ]
        return s.content or None, calls

    def streaming(self, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self, max_calls)

    def tool_schema(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            f = t.get("function", {})
            if f.get("name") == name:
                return f.get("parameters") or {}
        return {}


class ToolCallStream:
    """One reply's deltas -> (content delta, tool call deltas). Content goes out only where no call
    may start; a call goes out once its name is complete (index, id, type, name), then its
    arguments as they become certain."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = ""
        self.args_sent: list[str] = []
        self.ids: list[str] = []

    @property
    def calls_sent(self) -> int:
        return len(self.ids)

    def feed(self, delta: str) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        return self._diff(self.parser.scan(self.text, False))

    def finish(self) -> tuple[str | None, list[DeltaToolCall]]:
        return self._diff(self.parser.scan(self.text, True))

    def _diff(self, s: Scan) -> tuple[str | None, list[DeltaToolCall]]:
        content = None
        if s.content.startswith(self.content_sent) and len(s.content) > len(self.content_sent):
            content = s.content[len(self.content_sent):]
            self.content_sent = s.content
        deltas = []
        calls = s.calls if self.max_calls is None else s.calls[: self.max_calls]
        for i, c in enumerate(calls):
            if c.name is None:
                break
            new = i >= len(self.ids)
            if new:
                self.ids.append(tool_call_id())
                self.args_sent.append("")
            args = c.arguments if c.arguments is not None else c.prefix
            fragment = None
            if args.startswith(self.args_sent[i]) and len(args) > len(self.args_sent[i]):
                fragment = args[len(self.args_sent[i]):]
                self.args_sent[i] = args
            if new:
                deltas.append(DeltaToolCall(index=i, id=self.ids[i], type="function",
                                            function=DeltaFunctionCall(name=c.name, arguments=fragment or "")))
            elif fragment:
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=fragment)))
        return content, deltas
