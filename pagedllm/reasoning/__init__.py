"""Reasoning parsers: where a reasoning model's thinking (`<think>...</think>`) ends.

The engine core asks `is_reasoning_end(token_ids)` to know when a structure starts being enforced;
the chat server splits a reply into `reasoning_content` and `content` with `extract_reasoning` (a
whole reply) or a per-request `ReasoningStream` (deltas, exact whatever the chunk boundaries).
Plain Python: no torch."""

from __future__ import annotations

from pagedllm.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStream,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name` (ValueError naming the known ones otherwise)."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]
