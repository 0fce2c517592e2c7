"""A bundled, seeded set of JSON schemas for structured-output benchmarks and tests.

`varied_schemas(n, seed)` gives n schemas that together use what applications send: nested
objects, arrays with minItems / maxItems, enums, const, anyOf, string patterns and lengths, numbers
with bounds, nullable fields, `additionalProperties: false`, and `$ref` into `$defs`. Each comes
with a prompt asking for it. The same (n, seed) always gives the same schemas.
"""

from __future__ import annotations

import json
import random
from typing import Any

_NAMES = ["name", "title", "city", "country", "email", "status", "id", "count", "price", "score", "tags",
          "items", "owner", "address", "date", "level", "color", "size", "enabled", "notes", "rating", "year"]
_WORDS = ["red", "green", "blue", "small", "medium", "large", "open", "closed", "pending", "alpha", "beta",
          "north", "south", "low", "high"]
_PATTERNS = [r"^[A-Z]{2}[0-9]{3}$", r"^[a-z]+(-[a-z]+)*$", r"^\d{4}-\d{2}-\d{2}$", r"^#[0-9a-f]{6}$",
             r"^[a-z]{3,8}@[a-z]{3,8}\.com$"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "string_len", "pattern", "integer", "number", "boolean", "enum", "const",
                       "nullable", "int_enum"])
    if kind == "string":
        return {"type": "string"}
    if kind == "string_len":
        lo = rng.randint(1, 4)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(2, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        lo = round(rng.uniform(-10, 10), 1)
        return {"type": "number", "minimum": lo, "maximum": round(lo + rng.uniform(1, 100), 1)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 5))}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    if kind == "int_enum":
        return {"type": "integer", "enum": sorted(rng.sample(range(100), 3))}
    return {"type": ["string", "null"], "maxLength": 16}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    r = rng.random()
    if depth <= 0 or r < 0.45:
        return _leaf(rng)
    if r < 0.65:
        arr: dict[str, Any] = {"type": "array", "items": _node(rng, depth - 1)}
        lo = rng.randint(0, 2)
        arr["minItems"] = lo
        arr["maxItems"] = lo + rng.randint(1, 3)
        return arr
    if r < 0.75:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _object(rng, depth - 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_NAMES, rng.randint(1, 4))
    props = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    obj: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.7:
        obj["additionalProperties"] = False
    return obj


def varied_schemas(n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """n JSON schemas of varied features (see the module's doc); deterministic in (n, seed)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        schema = _object(rng, depth=rng.randint(1, 3))
        if i % 5 == 4:  # a shared definition referenced twice
            schema = {"$defs": {"item": _object(rng, 0)}, "type": "object",
                      "properties": {"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}},
                      "required": ["first", "second"], "additionalProperties": False}
        out.append(schema)
    return out


def schema_prompt(schema: dict[str, Any]) -> str:
    """A prompt asking for a JSON value of `schema`."""
    return f"Reply with a JSON object that follows this JSON schema:\n{json.dumps(schema)}\nJSON:"


REGEXES = [r"[0-9]{3}-[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,10} [A-Z][a-z]{2,10}",
           r"\d{4}-\d{2}-\d{2}", r"[a-z]+@[a-z]+\.(com|org|net)"]
CHOICES = [["positive", "negative", "neutral"], ["yes", "no"], ["red", "green", "blue", "yellow"],
           ["Paris", "London", "Berlin", "Madrid", "Rome"]]
