"""Structured output at the router: OpenAI ``response_format`` and gRPC ``json_schema`` to the
schema text the pools constrain to, checked here (torch-free, before any worker is touched).

A schema is refused (INVALID_ARGUMENT / HTTP 400, the message naming the field and the problem)
when it is over ``router.max_json_schema_bytes``, not JSON, not a JSON Schema, or uses a feature
llguidance cannot compile (a look-around pattern, a remote ``$ref``, ...): the same check and
compile the pools run (``common.json_schema``; with no vocabulary, not the model's tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cluster.common.errors import invalid
from cluster.common.json_schema import schema_grammar

JSON_OBJECT_SCHEMA = '{"type":"object"}'  # JSON mode: any JSON object


def canonical(schema: Any) -> str:
    """Compact JSON text (key order kept: it is the order the output's properties come in)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_schema(text: str, field: str, max_bytes: int) -> str:
    """``text`` (a JSON Schema's JSON text) if the pools can constrain to it."""
    try:
        schema_grammar(text, field, max_bytes)
    except ValueError as e:
        raise invalid(str(e)) from None
    return text


def response_format(value: Any, max_bytes: int) -> str | None:
    """OpenAI ``response_format`` -> the schema text to constrain to (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid("response_format: must be an object with a type")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise invalid(f"response_format.{extra[0]}: unsupported field")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise invalid(
            f"response_format.type: must be text, json_object or json_schema, got {kind!r}"
        )
    return _json_schema_format(value.get("json_schema"), max_bytes)


def _json_schema_format(spec: Any, max_bytes: int) -> str:
    """``response_format.json_schema`` (name, description, schema, strict) -> the schema text."""
    if not isinstance(spec, Mapping):
        raise invalid("response_format.json_schema: must be an object with name and schema")
    unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if unknown:
        raise invalid(f"response_format.json_schema.{unknown[0]}: unsupported field")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("response_format.json_schema.name: must be a non-empty string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("response_format.json_schema.strict: must be true or false")
    schema = spec.get("schema", {})  # OpenAI: absent means any JSON
    if not isinstance(schema, Mapping):
        raise invalid("response_format.json_schema.schema: must be an object")
    field = "response_format.json_schema.schema"
    try:
        text = canonical(schema)
    except RecursionError:  # the body parsed, but re-encoding runs a few frames deeper
        raise invalid(f"{field}: nested too deeply") from None
    return check_schema(text, field, max_bytes)
