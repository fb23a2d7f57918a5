"""A JSON Schema as the pools constrain output to it: checked, then compiled to an llguidance
grammar. Torch-free and shared: the router refuses a bad schema with the very check and compile
the engine runs (with no vocabulary: a millisecond or so), before any worker is touched.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

# Compact JSON, no freedom in whitespace: a small model cannot wander into endless spaces.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def schema_grammar(text: str, field: str, max_bytes: int) -> str:
    """The llguidance grammar of the JSON Schema ``text``, or ``ValueError`` naming ``field`` and
    the problem: over ``max_bytes`` (``router.max_json_schema_bytes``), not JSON (nested too
    deeply included), not an object, or a feature llguidance cannot compile (a look-around
    pattern, a remote ``$ref``, nesting past its own limit)."""
    _check_parses_to_object(text, field, max_bytes)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text,
            overrides=JSON_OPTIONS,  # type: ignore[arg-type]
        )
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as e:
        error = str(e)
    if error:
        raise ValueError(f"{field}: unsupported or invalid JSON Schema: {error}")
    return grammar


def _check_parses_to_object(text: str, field: str, max_bytes: int) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ValueError(
            f"{field}: the schema is {size} bytes, over the limit of {max_bytes} bytes "
            "(router.max_json_schema_bytes)"
        )
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{field}: not valid JSON ({e})") from None
    except RecursionError:  # a hostile "[[[[...": the parser's stack, not a crash of the caller
        raise ValueError(f"{field}: not valid JSON (nested too deeply to parse)") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON Schema must be an object, got {type(schema).__name__}")
