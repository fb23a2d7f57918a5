"""Structured output at the router: ``response_format`` (HTTP) and ``json_schema`` (gRPC) become
the schema text the pools constrain to; a bad schema is refused before any worker (400 /
INVALID_ARGUMENT naming the field and the problem) in well under 50 ms."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.tokenizer import FakeTokenizer
from cluster.config import RouterConfig
from cluster.config.model_paths import ModelLimits
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.requests import RequestParser, json_object
from tests.structured_schemas import BAD_SCHEMAS, SCHEMAS

VOCAB, CTX, BLOCK = 512, 128, 16
LIMIT = 8192
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def parser() -> RequestParser:
    router = RouterConfig(max_json_schema_bytes=LIMIT)
    return RequestParser(FakeTokenizer(VOCAB), ModelLimits(CTX, VOCAB), "m", BLOCK, router)


def _refused(fn: Any, arg: Any) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(PDServeError) as info:
        fn(arg)
    elapsed = time.perf_counter() - t0
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    return info.value.message, elapsed


def _json_schema(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, **extra}}


def test_text_is_the_default_and_json_modes_map_to_a_schema(parser: RequestParser) -> None:
    assert (
        parser.from_chat({**CHAT, "response_format": {"type": "text"}}).params.json_schema is None
    )
    assert (
        parser.from_completion({"prompt": "x", "response_format": None}).params.json_schema is None
    )
    p = parser.from_chat({**CHAT, "response_format": {"type": "json_object"}})
    assert p.params.json_schema == '{"type":"object"}'
    for name, schema in SCHEMAS.items():
        body = {**CHAT, "response_format": _json_schema(schema, strict=True)}
        got = parser.from_chat(body).params.json_schema
        assert got is not None and json.loads(got) == schema, name
        assert list(json.loads(got)) == list(schema)  # key order kept: the output's order
    p = parser.from_completion({"prompt": "x", "response_format": _json_schema(SCHEMAS["enums"])})
    assert p.params.json_schema is not None


def test_grpc_json_schema(parser: RequestParser) -> None:
    text = json.dumps(SCHEMAS["person"])
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(json_schema=text))
    assert parser.from_grpc(req).params.json_schema == text
    assert parser.from_grpc(pb.GenerateRequest(prompt="x")).params.json_schema is None
    for name, (bad, phrase) in BAD_SCHEMAS.items():
        req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(json_schema=bad))
        message, elapsed = _refused(parser.from_grpc, req)
        assert message.startswith("json_schema:") and phrase in message, (name, message)
        assert elapsed < 0.05, (name, elapsed)


# HTTP carries the schema as JSON: it cannot be invalid JSON there (gRPC's text can).
@pytest.mark.parametrize("name", sorted(set(BAD_SCHEMAS) - {"not_json"}))
def test_bad_schemas_are_refused_over_http_naming_the_problem(
    parser: RequestParser, name: str
) -> None:
    text, phrase = BAD_SCHEMAS[name]
    schema = json.loads(text)
    body = {**CHAT, "response_format": _json_schema(schema)}
    message, elapsed = _refused(parser.from_chat, body)
    assert message.startswith("response_format.json_schema.schema:"), message
    if name != "not_an_object":
        assert phrase in message, message
    assert elapsed < 0.05, elapsed


def test_a_schema_over_the_size_limit_is_refused_fast(parser: RequestParser) -> None:
    big = {"enum": [f"value-{i}" for i in range(2000)]}
    message, elapsed = _refused(parser.from_chat, {**CHAT, "response_format": _json_schema(big)})
    assert "over the limit of 8192 bytes" in message and "max_json_schema_bytes" in message
    assert elapsed < 0.05, elapsed
    req = pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParameters(json_schema=json.dumps(big))
    )
    message, _ = _refused(parser.from_grpc, req)
    assert message.startswith("json_schema:") and "over the limit" in message


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        ("json", "response_format"),
        ({"type": "grammar"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        (_json_schema({}, strict="yes"), "response_format.json_schema.strict"),
        (_json_schema({}, examples=[]), "response_format.json_schema.examples"),
        (_json_schema([1]), "response_format.json_schema.schema"),
        ({"type": "text", "extra": 1}, "response_format.extra"),
    ],
)
def test_malformed_response_format(parser: RequestParser, response_format: Any, field: str) -> None:
    message, _ = _refused(parser.from_chat, {**CHAT, "response_format": response_format})
    assert message.startswith(field + ":"), message


def test_a_deeply_nested_body_or_schema_is_refused_naming_the_problem(
    parser: RequestParser,
) -> None:
    """Hostile nesting is a 400 naming the problem, never a RecursionError (a 500)."""
    deep = ("[" * 4000 + "]" * 4000).encode()  # within the 8 KiB schema limit
    with pytest.raises(PDServeError) as info:
        json_object(b'{"messages": ' + deep + b"}")
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.message == "body: not valid JSON (nested too deeply to parse)"
    schema: dict[str, Any] = {}
    for _ in range(300):  # parses as JSON, nests past what the grammar compiler takes
        schema = {"items": schema}
    body = {**CHAT, "response_format": _json_schema(schema)}
    message, _ = _refused(parser.from_chat, body)
    assert message.startswith("response_format.json_schema.schema: unsupported"), message
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(json_schema=deep.decode()))
    message, _ = _refused(parser.from_grpc, req)
    assert message == "json_schema: not valid JSON (nested too deeply to parse)"
