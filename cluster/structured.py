"""Structured output: a request's ``response_format`` (OpenAI's ``json_object`` and
``json_schema``) or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` as the one
regular expression the replicas decode under (``replicas.grammar``).

A JSON schema becomes a regular expression by outlines-core's ``build_regex_from_schema``:
keys in the schema's order, at most one space between tokens of JSON, strings without
``\\u`` escapes, recursion unrolled three levels deep. ``not`` and ``if``/``then``/``else``
are refused; numeric bounds (``minimum``, ``multipleOf``), ``uniqueItems`` and
``maxProperties`` are not enforced (docs/api.md "Structured output").
"""

from __future__ import annotations

import json
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

MAX_SCHEMA_CHARS = 65_536  # a schema's JSON text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# what Rust's regex syntax reads as an operator (regex_syntax::escape escapes these)
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
EMAIL = r"[a-zA-Z0-9._%+\-]+@[a-zA-Z0-9.\-]+\.[a-zA-Z]{2,}"  # ``format: email``, JSON-safe
# ``json_object``: any JSON object (outlines' generic object, nested three levels deep)
ANY_OBJECT = {"type": "object"}


class StructureError(ValueError):
    """A structure request that cannot be served; ``param``: the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def literal(text: str) -> str:
    """``text`` as a regular expression that matches it alone."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _json_safe(schema: Any) -> Any:
    """``schema`` with each ``format: email`` as ``EMAIL``: outlines-core's email regex takes
    a quoted local part whose quotes JSON does not escape (``"email": ""a"@b.c"``)."""
    if isinstance(schema, list):
        return [_json_safe(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    safe = {key: _json_safe(value) for key, value in schema.items()}
    if safe.get("format") == "email":
        del safe["format"]
        safe["pattern"] = EMAIL
    return safe


def schema_regex(schema: Any, param: str) -> str:
    """The regular expression of a JSON schema (a dict, or its JSON text)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise StructureError(f"the schema has {len(text)} characters; at most {MAX_SCHEMA_CHARS}", param)
    try:
        parsed = json.loads(text)
        if not isinstance(parsed, dict):
            raise StructureError("the schema must be a JSON object", param)
        return build_regex_from_schema(json.dumps(_json_safe(parsed)))
    except json.JSONDecodeError as exc:
        raise StructureError(f"the schema is not JSON: {exc}", param) from None
    except (ValueError, TypeError, RuntimeError) as exc:
        raise StructureError(f"the schema is not supported: {exc}", param) from None


def _response_format_regex(response_format: Any) -> str | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise StructureError("must be an object with a 'type'", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_regex(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise StructureError("json_schema must be an object whose 'schema' is a JSON schema",
                                 "response_format")
        schema = spec.get("schema", {})
        return schema_regex({} if schema is True else schema, "response_format")
    raise StructureError(f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'", "response_format")


def _choice_regex(choices: Any) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise StructureError("must be a non-empty list of non-empty strings", "guided_choice")
    if len(choices) > MAX_CHOICES or any(len(c) > MAX_CHOICE_CHARS for c in choices):
        raise StructureError(f"takes at most {MAX_CHOICES} choices of at most {MAX_CHOICE_CHARS} characters",
                             "guided_choice")
    return "(" + "|".join(literal(c) for c in choices) + ")"


def constraint_regex(response_format: Any = None, guided_json: Any = None, guided_regex: Any = None,
                     guided_choice: Any = None) -> tuple[str, str] | None:
    """The field that asks for a structure and the one regular expression a request's answer
    must match, or None (free text); raises StructureError naming the field at fault."""
    asked = {name: value for name, value in (("response_format", _response_format_regex(response_format)),
                                             ("guided_json", guided_json), ("guided_regex", guided_regex),
                                             ("guided_choice", guided_choice)) if value is not None}
    if len(asked) > 1:
        raise StructureError(f"ask for one structure at a time, not {' and '.join(asked)}", sorted(asked)[1])
    if not asked:
        return None
    [(name, value)] = asked.items()
    if name == "guided_json":
        value = schema_regex(value, name)
    elif name == "guided_regex" and (not isinstance(value, str) or not value):
        raise StructureError("must be a non-empty regular expression", name)
    elif name == "guided_choice":
        value = _choice_regex(value)
    return name, value
