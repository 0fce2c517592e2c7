"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each value is typed by the tool's parameter schema (string as written; integer, number, boolean;
object and array as JSON); a parameter the schema does not name stays a string."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import PartialCall, Scan, ToolParser, content_before, dumps

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.S)


class Qwen3XmlToolParser(ToolParser):
    name = "qwen3_xml"
    START, FUNC = "<tool_call>", "<function="

    def scan(self, text: str, final: bool) -> Scan:
        content, pos = content_before(text, final, self.START, self.FUNC)
        if pos < 0:
            return Scan(content)
        calls: list[PartialCall] = []
        for m in _FUNCTION.finditer(text, pos):
            name = m.group(1).strip()
            end = text.find("</function>", m.end())
            closed = end >= 0
            body = text[m.end(): end if closed else len(text)]
            if closed or final:
                args = self._params(name, body, complete=True)
                if args is None:
                    return Scan(text) if final else Scan(content, calls)
                calls.append(PartialCall(name, dumps(args)))
            else:
                args = self._params(name, body, complete=False) or {}
                calls.append(PartialCall(name, prefix=dumps(args)[:-1] if args else "{"))
                break
        if final and not calls:
            return Scan(text)
        return Scan(content, calls)

    def _params(self, name: str, body: str, complete: bool) -> dict[str, Any] | None:
        props = self.tool_schema(name).get("properties") or {}
        out: dict[str, Any] = {}
        for m in _PARAM.finditer(body):
            if not complete and not body.startswith("</parameter>", m.end(2)):
                break  # the value may go on
            key = m.group(1).strip()
            value = m.group(2)
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            out[key] = convert(value, props.get(key))
        return out

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        parts = []
        for n, a in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else dumps(v)}\n</parameter>\n" for k, v in a.items()
            )
            parts.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
        return "\n".join(parts)


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema names (the text itself where it does not fit)."""
    if not isinstance(schema, dict):
        return value
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    v = value.strip()
    for t in types:
        if t == "string":
            return value
        if t == "integer":
            try:
                return int(v)
            except ValueError:
                continue
        if t == "number":
            try:
                f = float(v)
            except ValueError:
                continue
            return int(v) if re.fullmatch(r"-?\d+", v) else f
        if t == "boolean" and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if t == "null" and v.lower() in ("null", "none"):
            return None
        if t in ("object", "array"):
            try:
                return json.loads(v)
            except ValueError:
                try:
                    return ast.literal_eval(v)
                except (ValueError, SyntaxError):
                    continue
    return value
