"""Rendering for each API: the OpenAI shapes parse with the official client's own types."""

from __future__ import annotations

import json

import grpc
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import StreamChunk, Usage
from cluster.common.tokenizer import FakeTokenizer
from cluster.config import RouterConfig
from cluster.config.model_paths import ModelLimits
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.auth import ApiKeyAuth
from cluster.router.requests import RequestParser
from cluster.router.responses import (
    ChatStream,
    CompletionStream,
    aggregate_chat,
    aggregate_completion,
    grpc_chunk,
    grpc_status,
    openai_error,
)

TOK = FakeTokenizer(512)


def parsed(kind: str, **body):  # type: ignore[no-untyped-def]
    parser = RequestParser(TOK, ModelLimits(256, 512), "m", 16, RouterConfig())
    if kind == "chat":
        return parser.from_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    return parser.from_completion({"prompt": "t1 t2 t3", **body})


def chunks(logprobs: bool = False) -> list[StreamChunk]:
    usage = Usage(3, 3, 0, "remote", draft_tokens=4, accepted_draft_tokens=1)
    usage.phases["prefill_ms"] = 5.0
    lp = [-0.5] if logprobs else None
    top = [[(7, -0.5), (8, -1.5)]] if logprobs else None
    return [
        StreamChunk("r", [7], " t7", lp, top),
        StreamChunk("r", [8], " t8", lp and [-0.25], top and [[(8, -0.25)]]),
        StreamChunk("r", [9], " t9", lp and [-0.1], top and [[(9, -0.1)]], "length", usage),
    ]


def sse_payloads(events: list[str]) -> list[dict]:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_completion_non_streaming_parses_with_openai_types() -> None:
    p = parsed("completion", logprobs=1)
    body = aggregate_completion(p, "m", chunks(logprobs=True), TOK)
    c = Completion.model_validate(body)
    assert c.choices[0].text == " t7 t8 t9" and c.choices[0].finish_reason == "length"
    assert c.usage is not None and c.usage.total_tokens == 6
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens == [" t7", " t8", " t9"]
    assert lp.text_offset == [0, 3, 6] and lp.token_logprobs == [-0.5, -0.25, -0.1]
    assert body["usage"]["pdserve"]["prefill_mode"] == "remote"
    assert body["usage"]["pdserve"]["phases"]["prefill_ms"] == 5.0
    spec = body["usage"]["pdserve"]["speculative"]
    assert spec == {"draft_tokens": 4, "accepted_draft_tokens": 1}


def test_chat_non_streaming_parses_with_openai_types() -> None:
    body = aggregate_chat(parsed("chat", logprobs=True, top_logprobs=2), "m", chunks(True), TOK)
    c = ChatCompletion.model_validate(body)
    assert c.choices[0].message.content == " t7 t8 t9"
    assert c.choices[0].message.role == "assistant"
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [t.token for t in content] == [" t7", " t8", " t9"]
    assert [t.token for t in content[0].top_logprobs] == [" t7", " t8"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_events(include_usage: bool) -> None:
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    p = parsed("chat", stream=True, **opts)
    fmt = ChatStream(p, "m", TOK)
    events = [e for c in chunks() for e in fmt.events(c)] + list(fmt.finish())
    payloads = sse_payloads(events)
    parsed_chunks = [ChatCompletionChunk.model_validate(x) for x in payloads]
    assert parsed_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in parsed_chunks if c.choices)
    assert text == " t7 t8 t9"
    finishes = [c.choices[0].finish_reason for c in parsed_chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    if include_usage:
        assert parsed_chunks[-1].choices == [] and parsed_chunks[-1].usage is not None
        assert parsed_chunks[-1].usage.completion_tokens == 3
        assert all(c.usage is None for c in parsed_chunks[:-1])
    else:
        assert all("usage" not in x for x in payloads)


def test_completion_stream_events() -> None:
    p = parsed("completion", stream=True, logprobs=0, stream_options={"include_usage": True})
    fmt = CompletionStream(p, "m", TOK)
    events = [e for c in chunks(True) for e in fmt.events(c)] + list(fmt.finish())
    payloads = sse_payloads(events)
    # Streamed completion chunks carry finish_reason null until the last (the openai client
    # builds stream chunks without validation; its strict type requires a reason).
    objs = [
        Completion.model_validate(x)
        if not x["choices"] or x["choices"][0]["finish_reason"]
        else Completion.model_construct(**x)
        for x in payloads
    ]
    assert all(x["object"] == "text_completion" and x["id"] == p.request_id for x in payloads)
    assert "".join(x["choices"][0]["text"] for x in payloads if x["choices"]) == " t7 t8 t9"
    offsets = [x["choices"][0]["logprobs"]["text_offset"] for x in payloads if x["choices"]]
    assert offsets == [[0], [3], [6]]
    assert objs[-1].usage is not None and objs[-1].usage.prompt_tokens == 3


def test_grpc_chunk_carries_tokens_logprobs_usage() -> None:
    msgs = [grpc_chunk(c) for c in chunks(True)]
    assert [list(m.token_ids) for m in msgs] == [[7], [8], [9]]
    assert msgs[0].finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[0].logprobs[0].top[1].token_id == 8
    assert msgs[-1].usage.prefill_mode == "remote"
    assert msgs[-1].usage.phases.prefill_ms == 5.0
    assert (msgs[-1].usage.draft_tokens, msgs[-1].usage.accepted_draft_tokens) == (4, 1)
    assert not msgs[0].HasField("usage")


@pytest.mark.parametrize(
    ("code", "status", "grpc_code"),
    [
        (ErrorCode.INVALID_ARGUMENT, 400, grpc.StatusCode.INVALID_ARGUMENT),
        (ErrorCode.UNAUTHENTICATED, 401, grpc.StatusCode.UNAUTHENTICATED),
        (ErrorCode.RESOURCE_EXHAUSTED, 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ErrorCode.PAYLOAD_TOO_LARGE, 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ErrorCode.UNAVAILABLE, 503, grpc.StatusCode.UNAVAILABLE),
        (ErrorCode.DEADLINE_EXCEEDED, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
        (ErrorCode.ABORTED, 502, grpc.StatusCode.ABORTED),
    ],
)
def test_error_mapping(code: ErrorCode, status: int, grpc_code: grpc.StatusCode) -> None:
    err = PDServeError(code, "max_tokens: must be >= 1", "rid-1")
    got_status, body = openai_error(err)
    assert got_status == status and grpc_status(err) == grpc_code
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["request_id"] == "rid-1"
    if code == ErrorCode.INVALID_ARGUMENT:
        assert body["error"]["param"] == "max_tokens"
        assert body["error"]["type"] == "invalid_request_error"


def test_api_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert not ApiKeyAuth(RouterConfig()).enabled
    ApiKeyAuth(RouterConfig()).check(None)  # off: anything passes
    keys_file = tmp_path / "keys"
    keys_file.write_text("# ops\nfile-key-123456\n")
    auth = ApiKeyAuth(RouterConfig(api_keys=("inline-key-1234",), api_keys_file=str(keys_file)))
    assert auth.enabled
    auth.check("Bearer inline-key-1234")
    auth.check("bearer file-key-123456")
    for bad in (
        None,
        "",
        "Bearer",
        "Bearer wrong-key-0000",
        "Basic inline-key-1234",
        "inline-key-1234",
    ):
        with pytest.raises(PDServeError) as info:
            auth.check(bad)
        assert info.value.code == ErrorCode.UNAUTHENTICATED
        assert "inline" not in info.value.message
    with pytest.raises(ValueError, match="api_keys_file"):
        ApiKeyAuth(RouterConfig(api_keys_file=str(tmp_path / "missing")))


def sample_chunks() -> list[StreamChunk]:
    """Two samples streamed interleaved (index 1 ends first); the usage comes last, once."""
    usage = Usage(3, 5)
    return [
        StreamChunk("r", [7], " t7", [-0.5], [[]], index=0),
        StreamChunk("r", [8], " t8", [-0.1], [[]], index=1),
        StreamChunk("r", [9], " t9", [-0.1], [[]], "stop", index=1),
        StreamChunk("r", [10, 11], " t10 t11", [-2.0, -1.0], [[], []], "length", usage, index=0),
    ]


def test_n_choices_non_streaming_and_streaming() -> None:
    body = aggregate_completion(parsed("completion", n=2), "m", sample_chunks(), TOK)
    c = Completion.model_validate(body)
    assert [(x.index, x.text, x.finish_reason) for x in c.choices] == [
        (0, " t7 t10 t11", "length"),
        (1, " t8 t9", "stop"),
    ]
    assert c.usage is not None and (c.usage.prompt_tokens, c.usage.completion_tokens) == (3, 5)
    chat = ChatCompletion.model_validate(
        aggregate_chat(parsed("chat", n=2), "m", sample_chunks(), TOK)
    )
    assert [x.message.content for x in chat.choices] == [" t7 t10 t11", " t8 t9"]

    fmt = ChatStream(parsed("chat", n=2, stream=True), "m", TOK)
    events = [e for ch in sample_chunks() for e in fmt.events(ch)] + list(fmt.finish())
    got = [ChatCompletionChunk.model_validate(x) for x in sse_payloads(events)]
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in got[:2]]
    assert roles == [(0, "assistant"), (1, "assistant")]
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for c in got[2:]:
        ch = c.choices[0]
        text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
        finish[ch.index] = ch.finish_reason
    assert text == {0: " t7 t10 t11", 1: " t8 t9"} and finish == {0: "length", 1: "stop"}


def test_best_of_returns_the_n_most_likely_without_unasked_logprobs() -> None:
    p = parsed("completion", n=1, best_of=2)
    c = Completion.model_validate(aggregate_completion(p, "m", sample_chunks(), TOK))
    # Sample 1 (total -0.2) beats sample 0 (-3.5); re-indexed 0; logprobs were not asked for.
    assert [(x.index, x.text, x.logprobs) for x in c.choices] == [(0, " t8 t9", None)]
    assert c.usage is not None and c.usage.completion_tokens == 5  # every sample generated
    shown = parsed("completion", n=1, best_of=2, logprobs=0)
    c = Completion.model_validate(aggregate_completion(shown, "m", sample_chunks(), TOK))
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.token_logprobs == [-0.1] * 2


def test_echo_prepends_the_prompt_to_each_choice() -> None:
    p = parsed("completion", n=2, echo=True)
    c = Completion.model_validate(aggregate_completion(p, "m", sample_chunks(), TOK))
    assert [x.text for x in c.choices] == ["t1 t2 t3 t7 t10 t11", "t1 t2 t3 t8 t9"]
    fmt = CompletionStream(parsed("completion", n=2, echo=True, stream=True), "m", TOK)
    events = [e for ch in sample_chunks() for e in fmt.events(ch)] + list(fmt.finish())
    texts: dict[int, str] = {}
    for x in sse_payloads(events):
        ch = x["choices"][0]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {0: "t1 t2 t3 t7 t10 t11", 1: "t1 t2 t3 t8 t9"}


def test_echo_with_logprobs_leads_each_choice_with_the_prompt_tokens() -> None:
    """OpenAI's legacy shape: the prompt's tokens first (null logprob for the first), their
    offsets from 0, then the completion's; streamed, the choice's first chunk carries them."""
    prompt_lps = [None, (-1.0, [(2, -0.5)]), (-2.0, [(1, -0.25)])]
    stream = [
        StreamChunk("r", [7], " t7", [-0.5], [[(7, -0.5)]], prompt_logprobs=prompt_lps),
        StreamChunk("r", [8], " t8", [-0.25], [[(8, -0.25)]], "length", Usage(3, 2)),
    ]
    p = parsed("completion", echo=True, logprobs=1)
    assert p.params.prompt_logprobs == 1
    # (openai's pydantic types declare float items, though the API sends that null: the client
    # does not validate responses, so it is checked here as JSON; tests/serve reads it back.)
    choice = aggregate_completion(p, "m", stream, TOK)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "t1 t2 t3 t7 t8"
    assert lp["tokens"] == [" t1", " t2", " t3", " t7", " t8"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5, -0.25]
    tops = [None, {" t2": -0.5}, {" t1": -0.25}, {" t7": -0.5}, {" t8": -0.25}]
    assert lp["top_logprobs"] == tops
    assert lp["text_offset"] == [0, 3, 6, 8, 11]
    fmt = CompletionStream(parsed("completion", echo=True, logprobs=1, stream=True), "m", TOK)
    events = [e for ch in stream for e in fmt.events(ch)] + list(fmt.finish())
    first, second = (x["choices"][0]["logprobs"] for x in sse_payloads(events))
    assert first["tokens"] == [" t1", " t2", " t3", " t7"] and first["token_logprobs"][0] is None
    assert second["tokens"] == [" t8"] and second["text_offset"] == [11]


def test_grpc_chunk_carries_the_sample_index() -> None:
    assert [grpc_chunk(c).index for c in sample_chunks()] == [0, 1, 1, 0]
