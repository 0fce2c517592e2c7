"""Tool-call parsers of /v1/chat/completions (`--tool-call-parser NAME`), by vLLM's names."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallStream, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_formats import (
    HermesToolParser,
    JsonArrayToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3XmlToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser registered as `name` (ValueError naming the known ones otherwise)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "JsonArrayToolParser", "ToolCallStream", "ToolParser", "get_tool_parser"]
