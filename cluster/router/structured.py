"""Structured output at the router: OpenAI ``response_format`` and gRPC ``json_schema`` to the
schema text the pools constrain to, checked here (torch-free, before any worker is touched).

A schema is refused (INVALID_ARGUMENT / HTTP 400, the message naming the field and the problem)
when it is over ``router.max_json_schema_bytes``, not JSON, not a JSON Schema, or uses a feature
llguidance cannot compile (a look-around pattern, a remote ``$ref``, ...): the same compile the
pools run (with no vocabulary: a millisecond or so, not the model's tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

from cluster.common.errors import invalid

# As the engine compiles them (cluster.engine.structured.grammar.JSON_OPTIONS): compact JSON.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # JSON mode: any JSON object


def canonical(schema: Any) -> str:
    """Compact JSON text (key order kept: it is the order the output's properties come in)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_schema(text: str, field: str, max_bytes: int) -> str:
    """``text`` (a JSON Schema's JSON text) if the pools can constrain to it."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise invalid(
            f"{field}: the schema is {size} bytes, over the limit of {max_bytes} bytes "
            "(router.max_json_schema_bytes)"
        )
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise invalid(f"{field}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise invalid(f"{field}: a JSON Schema must be an object, got {type(schema).__name__}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as e:
        error = str(e)
    if error:
        raise invalid(f"{field}: unsupported or invalid JSON Schema: {error}")
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
    spec = value.get("json_schema")
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
    return check_schema(canonical(schema), "response_format.json_schema.schema", max_bytes)
