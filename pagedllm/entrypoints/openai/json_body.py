"""Checks on a request's raw JSON body that run before any route parses it."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request


def surrogate_error(body: bytes) -> OpenAIError | None:
    """The 400 for a JSON body that holds a lone surrogate, or None."""
    bad = lone_surrogate(body)
    if bad is None:
        return None
    return bad_request(f"{bad} is not valid Unicode text: it holds a lone surrogate (an unpaired \\uD800-\\uDFFF "
                       "escape)", bad)


def lone_surrogate(body: bytes) -> str | None:
    """The path of the first string in a JSON body that holds a lone surrogate (only a \\uD8xx-
    \\uDFxx escape can put one there), or None. Such text cannot be encoded or tokenized."""
    if b"\\ud" not in body.lower():
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None  # malformed JSON: the route's parser reports it

    def walk(value: object, path: str) -> str | None:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                found = walk(k, path) or walk(v, f"{path}.{k}" if path else str(k))
                if found:
                    return found
        elif isinstance(value, list):
            for i, v in enumerate(value):
                found = walk(v, f"{path}[{i}]")
                if found:
                    return found
        return None

    return walk(doc, "")
