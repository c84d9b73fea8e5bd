"""Bounds on what a json_schema reply may write where the schema sets none (docs/server.md, "JSON output is
bounded"): integers of at most 16 digits, numbers as large with at most 10 decimals, strings of at most STRING_MAX
characters; a bound the schema gives is kept, and values under keys it does not describe get the same bounds."""

from __future__ import annotations

from typing import Any

INTEGER_MAX = 10**16 - 1  # 16 digits, as llama.cpp's json-schema-to-grammar
NUMBER_STEP = 1e-10  # at most 10 decimals
STRING_MAX = 512  # characters
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SINGLE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "unevaluatedProperties")
_FREE: dict[str, Any] = {}  # the bounds of a value the schema leaves free (filled in below)


def bound_schema(schema: Any) -> Any:
    """A copy of `schema` (a JSON schema as Python objects) with every number and string bounded."""
    if schema is True:
        return dict(_FREE)
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bound_schema(s) for s in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bound_schema(s) for name, s in out[key].items()}
    for key in _SINGLE:
        if key in out:
            sub = out[key]
            out[key] = [bound_schema(s) for s in sub] if isinstance(sub, list) else bound_schema(sub)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = dict(_FREE)
    if "$ref" in out or "const" in out or "enum" in out:
        return out  # bounded where it points, or a fixed set of values
    kinds = _kinds(out.get("type"))
    if kinds is None or kinds & {"integer", "number"}:
        _bound_numbers(out, integer_only=kinds is not None and "number" not in kinds)
    if (kinds is None or "string" in kinds) and "maxLength" not in out:
        out["maxLength"] = max(STRING_MAX, int(out.get("minLength", 0)))
    return out


def _kinds(declared: Any) -> set[str] | None:
    """The JSON types a node allows (None: any)."""
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bound_numbers(out: dict[str, Any], integer_only: bool) -> None:
    for inclusive, exclusive, sign in (("minimum", "exclusiveMinimum", -1), ("maximum", "exclusiveMaximum", 1)):
        given = [v for v in (out.get(inclusive), out.get(exclusive)) if isinstance(v, (int, float)) and _number(v)]
        if not any(sign * v <= INTEGER_MAX for v in given):  # no bound of the schema's own within ours
            out.pop(exclusive, None)
            out[inclusive] = sign * INTEGER_MAX
    if not integer_only and "multipleOf" not in out:
        out["multipleOf"] = NUMBER_STEP


_FREE.update(bound_schema({}))
