"""One JSON-schema validator (``cluster.common.json_schema``) for the router and the engine: a bad
schema is refused with the same message on both sides, and hostile input (deep nesting, lone
surrogates, huge numbers) is a ``ValueError`` naming the problem, never a RecursionError."""

from __future__ import annotations

import json

import pytest

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.json_schema import schema_grammar
from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.router.structured import check_schema
from tests.helpers import fake_config
from tests.structured_schemas import BAD_SCHEMAS, SCHEMAS

LIMIT = 64 << 10
DEEP = 5000  # past the JSON parser's recursion limit
HOSTILE: dict[str, tuple[str, str]] = {
    # name: (schema text, a phrase the error message contains)
    "too_big": (json.dumps({"enum": [f"value-{i}" for i in range(9000)]}), "over the limit"),
    "deep_arrays": ("[" * DEEP + "]" * DEEP, "nested too deeply to parse"),
    "deep_objects": ('{"a":' * DEEP + "{}" + "}" * DEEP, "nested too deeply to parse"),
    "deep_schema": ('{"items":' * 300 + "{}" + "}" * 300, "unsupported or invalid JSON Schema"),
    "lone_surrogate": ('{"const": "\ud800"}', "unsupported or invalid JSON Schema"),
    "huge_integer": ('{"minimum": 1' + "0" * 5000 + "}", "not valid JSON"),
    "nan": ('{"minimum": NaN}', "unsupported or invalid JSON Schema"),
}
REFUSED = {**BAD_SCHEMAS, **HOSTILE}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_bad_schema_is_a_value_error_naming_the_field_and_problem(name: str) -> None:
    text, phrase = REFUSED[name]
    with pytest.raises(ValueError) as info:
        schema_grammar(text, "json_schema", LIMIT)
    message = str(info.value)
    assert message.startswith("json_schema: ") and phrase in message, message


def test_the_router_and_the_engine_refuse_with_the_same_message() -> None:
    engine = LLMEngine(
        fake_config(
            **{"router.max_json_schema_bytes": LIMIT, "testing.fake_model.ascii_tokens": True}
        )
    )
    for name, (text, _) in REFUSED.items():
        with pytest.raises(PDServeError) as routed:
            check_schema(text, "json_schema", LIMIT)
        assert routed.value.code == ErrorCode.INVALID_ARGUMENT
        with pytest.raises(ValueError) as engined:
            engine.add(EngineRequest(name, [1, 2], SamplingParams(json_schema=text)))
        assert routed.value.message == str(engined.value), name
    assert engine.structured.active_ids() == set()
    engine.check_integrity()


def test_a_good_schema_passes_the_router_unchanged_and_compiles() -> None:
    for schema in SCHEMAS.values():
        text = json.dumps(schema)
        assert check_schema(text, "json_schema", LIMIT) == text
        assert schema_grammar(text, "json_schema", LIMIT)
