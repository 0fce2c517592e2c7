"""Pythonic calls (Llama 3.2 / 4 style): a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), f(x=1)]`; values are Python literals."""

from __future__ import annotations

import ast
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import PartialCall, Scan, ToolParser, dumps

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_START_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _call(node: ast.expr) -> PartialCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    try:
        return PartialCall(name, dumps(args))
    except (TypeError, ValueError):
        return None  # a value JSON cannot hold (a set, bytes, a complex number)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> Scan:
        m = _START.search(text)
        if m is None:
            if final:
                return Scan(text)
            k = 0
            bracket = text.rfind("[")
            if bracket >= 0 and _START_PREFIX.match(text, bracket):
                k = len(text) - bracket
            return Scan(text[: len(text) - k])
        content, region = text[: m.start()], text[m.start():]
        if final:
            try:
                tree = ast.parse(region.strip(), mode="eval").body
            except SyntaxError:
                return Scan(text)
            if not isinstance(tree, ast.List) or not tree.elts:
                return Scan(text)
            calls = [_call(e) for e in tree.elts]
            if any(c is None for c in calls):
                return Scan(text)
            return Scan(content, calls)  # type: ignore[arg-type]
        return Scan(content, self._partial(region))

    @staticmethod
    def _partial(region: str) -> list[PartialCall]:
        """The calls of an unfinished list: each complete call, then the open one's name."""
        calls: list[PartialCall] = []
        depth, quote, i, item, name = 0, "", 0, 1, None
        while i < len(region):
            ch = region[i]
            if quote:
                if ch == "\\":
                    i += 2
                    continue
                if ch == quote:
                    quote = ""
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                if depth == 1 and ch == "(":
                    name = region[item:i].strip()
                depth += 1
            elif ch in ")]}":
                depth -= 1
                if depth == 1 and ch == ")":
                    try:
                        node = ast.parse(region[item: i + 1].strip(), mode="eval").body
                    except SyntaxError:
                        return calls
                    c = _call(node)
                    if c is None:
                        return calls
                    calls.append(c)
                    name = None
                if depth <= 0:
                    return calls
            elif ch == "," and depth == 1:
                item = i + 1
            i += 1
        if depth >= 2 and name and _NAME.fullmatch(name):
            calls.append(PartialCall(name))
        return calls

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
