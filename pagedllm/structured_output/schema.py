"""What the grammar backends can enforce of a JSON schema, and the rewrites a request's options ask for.

xgrammar compiles every JSON schema it can parse, but a few keywords it leaves unenforced (a
schema with `not` or `uniqueItems: true` compiles, and its outputs may break them). pagedllm never
serves a silently unconstrained reply: `xgrammar_unsupported` names those keywords, and the request
then goes to llguidance (which refuses what it cannot enforce, naming it) or is answered with an
error naming the keyword.
"""

from __future__ import annotations

import json
from typing import Any

# Keywords that xgrammar compiles without enforcing them (checked against matchers that accept
# violating instances); `uniqueItems` and `oneOf` are handled below.
_XGRAMMAR_UNENFORCED = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
    "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems", "allOf",
)
# Keywords no backend enforces (both refuse or ignore them); a schema using one gets an error.
_NEVER_ENFORCED = ("uniqueItems",)

# Subschema-holding keywords, to walk a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def load_schema(value: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON schema given as a dict or as its JSON text, as a dict (ValueError naming the problem)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
    return value


def check_schema(schema: dict[str, Any]) -> None:
    """Rejects a schema that is not a valid JSON schema (draft 2020-12), naming the problem."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {e.message}") from None


def _subschemas(node: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            out.extend(value.values())
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            out.extend(value)
    for key in _SCHEMA_ONE:
        value = node.get(key)
        if isinstance(value, dict):
            out.append(value)
    return out


def _walk(schema: Any) -> list[dict[str, Any]]:
    """Every (sub)schema object of `schema`, itself first."""
    nodes, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            nodes.append(node)
            stack.extend(_subschemas(node))
    return nodes


def _is_discriminated(branches: list[Any]) -> bool:
    """Whether oneOf's branches exclude each other through one property that each fixes to its own
    constant (pydantic's discriminated unions), so that matching any one means matching one only."""
    if not branches or not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    names = set.intersection(*(set(b["properties"]) for b in branches))
    for name in names:
        values = []
        for b in branches:
            prop = b["properties"][name]
            if not isinstance(prop, dict) or name not in b.get("required", []):
                break
            if "const" in prop:
                values.append(json.dumps(prop["const"], sort_keys=True))
            elif isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
                values.append(json.dumps(prop["enum"][0], sort_keys=True))
            else:
                break
        else:
            if len(set(values)) == len(values):
                return True
    return False


def never_enforced(schema: dict[str, Any]) -> list[str]:
    """Keywords in `schema` that no backend enforces."""
    found = set()
    for node in _walk(schema):
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        found.update(k for k in _NEVER_ENFORCED if k in node and k != "uniqueItems")
    return sorted(found)


def xgrammar_unsupported(schema: dict[str, Any]) -> list[str]:
    """Keywords in `schema` that xgrammar would compile without enforcing."""
    found = set()
    for node in _walk(schema):
        found.update(k for k in _XGRAMMAR_UNENFORCED if k in node)
        one_of = node.get("oneOf")
        if isinstance(one_of, list) and len(one_of) > 1 and not _is_discriminated(one_of):
            found.add("oneOf")
    return sorted(found)


def without_additional_properties(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say otherwise."""
    if isinstance(schema, list):
        return [without_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: without_additional_properties(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_ONE:
            out[key] = without_additional_properties(value)
        else:
            out[key] = value
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def ebnf_literal(text: str) -> str:
    """`text` as a double-quoted EBNF string literal (JSON escapes, which GBNF reads the same)."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)
