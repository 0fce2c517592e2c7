"""Tool-call formats whose calls are JSON objects: hermes, llama3_json, mistral, and the JSON array
that tool_choice "required" enforces."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    Scan,
    ToolParser,
    content_before,
    dumps,
    json_call,
    json_call_list,
)
from pagedllm.reasoning.parsers import held_suffix


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        content, pos = content_before(text, final, self.START)
        if pos < 0:
            return Scan(content)
        calls: list[PartialCall] = []
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            closed = end >= 0
            body = text[body_start:end] if closed else text[body_start:]
            if closed or final:
                c = json_call(body, True)
                if c is None:
                    if final:
                        return Scan(text)  # not a call: the reply is content
                    break
                calls.append(c)
            else:
                calls.append(json_call(body[: len(body) - held_suffix(body, self.END)], False))  # type: ignore[arg-type]
            if not closed:
                break
            pos = text.find(self.START, end + len(self.END))
        return Scan(content, calls)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(f'{self.START}\n{dumps({"name": n, "arguments": a})}\n{self.END}' for n, a in calls)


_JSON_CALL_START = re.compile(r'\{\s*"name"\s*:')
_JSON_CALL_START_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?$')


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
    several separated by `;`."""

    name = "llama3_json"
    needs_special_tokens = True
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        tag = text.find(self.TAG)
        m = _JSON_CALL_START.search(text)
        starts = [i for i in (tag, m.start() if m else -1) if i >= 0]
        if not starts:
            if final:
                return Scan(text)
            k = held_suffix(text, self.TAG)
            brace = text.rfind("{")
            if brace >= 0 and _JSON_CALL_START_PREFIX.match(text, brace):
                k = max(k, len(text) - brace)
            return Scan(text[: len(text) - k])
        start = min(starts)
        content = text[:start]
        body = text[start + len(self.TAG):] if start == tag else text[start:]
        decoder = json.JSONDecoder()
        calls: list[PartialCall] = []
        i = 0
        while True:
            while i < len(body) and body[i].isspace():
                i += 1
            if i == len(body):
                break
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                if final:
                    return Scan(text)
                calls.append(json_call(body[i:], False))  # type: ignore[arg-type]
                break
            c = json_call(json.dumps(obj), True, require_args=True)  # {"name": "Bob"} is not a call
            if c is None:
                if final:
                    return Scan(text)
                break
            calls.append(c)
            while i < len(body) and body[i].isspace():
                i += 1
            if i < len(body) and body[i] == ";":
                i += 1
            elif i < len(body):
                if final:
                    return Scan(text)
                break
        if final and not calls:
            return Scan(text)
        return Scan(content, calls)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(dumps({"name": n, "parameters": a}) for n, a in calls)


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]name[ARGS]{...}` (repeated for several calls)."""

    name = "mistral"
    needs_special_tokens = True
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> Scan:
        content, pos = content_before(text, final, self.TAG)
        if pos < 0:
            return Scan(content)
        rest = text[pos + len(self.TAG):]
        head = rest.lstrip()
        if not head:
            return Scan(text) if final else Scan(content)
        if head[0] in "[{":
            calls = json_call_list(rest, final, ("arguments", "parameters"))
            if calls is None or (final and not calls):
                return Scan(text)
            return Scan(content, calls)
        calls = []
        segments = rest.split(self.TAG)
        for j, seg in enumerate(segments):
            last = j == len(segments) - 1
            if self.ARGS not in seg:
                if final:
                    return Scan(text)
                break
            name, args = seg.split(self.ARGS, 1)
            name = name.strip()
            if not re.fullmatch(r"[a-zA-Z0-9_.-]{1,64}", name):
                if final:
                    return Scan(text)
                break
            if last and not final:
                c = json_call(dumps({"name": name}) [:-1] + ', "arguments": ' + args.rstrip(), False)
                # the arguments' text is the object's last member: parsed in place
                calls.append(c if c.name else PartialCall(name))
                continue
            try:
                obj = json.loads(args)
            except ValueError:
                if final:
                    return Scan(text)
                break
            if not isinstance(obj, dict):
                if final:
                    return Scan(text)
                break
            calls.append(PartialCall(name, dumps(obj)))
        return Scan(content, calls)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return self.TAG + dumps([{"name": n, "arguments": a} for n, a in calls])


class JsonArrayToolParser(ToolParser):
    """The reply tool_choice "required" enforces: a JSON array of {"name": ..., "parameters": {...}}."""

    name = "json_array"

    def scan(self, text: str, final: bool) -> Scan:
        if not text.strip():
            return Scan(text if final else "")
        calls = json_call_list(text, final, ("parameters", "arguments"))
        if calls is None or (final and not calls):
            return Scan(text)
        return Scan("", calls)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return dumps([{"name": n, "parameters": a} for n, a in calls])
