"""The router's validation and tokenization (reliability matrix B1-B5, B9): no worker involved."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.hashing import hash_block_tokens
from cluster.common.sampling_params import SamplingParams
from cluster.common.tokenizer import FakeTokenizer
from cluster.config import RouterConfig
from cluster.config.model_paths import ModelLimits
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.requests import RequestParser

VOCAB, CTX, BLOCK = 512, 128, 16


@pytest.fixture
def parser() -> RequestParser:
    return RequestParser(FakeTokenizer(VOCAB), ModelLimits(CTX, VOCAB), "m", BLOCK, RouterConfig())


def code_of(fn, *args) -> tuple[ErrorCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(PDServeError) as info:
        fn(*args)
    return info.value.code, info.value.message


def grpc_req(**kw) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    sampling = kw.pop("sampling", {})
    return pb.GenerateRequest(sampling=pb.SamplingParameters(**sampling), **kw)


# -- gRPC ----------------------------------------------------------------------------------------


def test_grpc_token_ids_are_hashed_like_the_engine(parser: RequestParser) -> None:
    ids = list(range(1, 40))
    p = parser.from_grpc(grpc_req(token_ids=pb.TokenIds(ids=ids), request_id="abc-1"))
    assert p.request_id == "abc-1"
    assert p.prompt_token_ids == ids
    assert p.block_hashes == hash_block_tokens(ids, BLOCK) and len(p.block_hashes) == 2
    assert p.params == SamplingParams()  # unset fields keep the defaults
    assert p.deadline is not None and p.deadline > time.time()


def test_grpc_optional_zero_differs_from_unset(parser: RequestParser) -> None:
    p = parser.from_grpc(
        grpc_req(prompt="hello world", sampling={"temperature": 0.0, "max_tokens": 5})
    )
    assert p.params.temperature == 0.0 and p.params.max_tokens == 5
    assert parser.from_grpc(grpc_req(prompt="hi")).params.temperature == 1.0


def test_grpc_chat_applies_the_template(parser: RequestParser) -> None:
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi there")])
    p = parser.from_grpc(grpc_req(messages=msgs))
    assert p.prompt_token_ids == FakeTokenizer(VOCAB).encode_chat(
        [{"role": "user", "content": "hi there"}]
    )


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        ({}, "prompt"),  # B1: no input at all
        ({"prompt": ""}, "prompt"),  # B1
        ({"token_ids": pb.TokenIds(ids=[])}, "prompt"),  # B1
        ({"token_ids": pb.TokenIds(ids=[1] * CTX)}, "prompt"),  # B2: prompt == context
        ({"token_ids": pb.TokenIds(ids=[1, -1])}, "prompt_token_ids"),  # B5
        ({"token_ids": pb.TokenIds(ids=[1, VOCAB])}, "prompt_token_ids"),  # B5
        ({"token_ids": pb.TokenIds(ids=[1, 2**62])}, "prompt_token_ids"),  # B5
        ({"prompt": "x", "sampling": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),  # B5
        ({"prompt": "x", "sampling": {"stop_token_ids": [-3]}}, "stop_token_ids"),  # B5
        ({"prompt": "x", "sampling": {"max_tokens": 0}}, "max_tokens"),  # B3
        ({"prompt": "x", "sampling": {"max_tokens": -5}}, "max_tokens"),  # B3
        ({"prompt": "x", "sampling": {"max_tokens": 2**31}}, "max_tokens"),  # B3
        ({"prompt": "x", "sampling": {"max_tokens": 4, "min_tokens": 5}}, "min_tokens"),  # B3
        ({"prompt": "x", "sampling": {"temperature": -0.1}}, "temperature"),  # B4
        ({"prompt": "x", "sampling": {"temperature": math.nan}}, "temperature"),  # B4
        ({"prompt": "x", "sampling": {"temperature": math.inf}}, "temperature"),  # B4
        ({"prompt": "x", "sampling": {"top_p": 0.0}}, "top_p"),  # B4
        ({"prompt": "x", "sampling": {"top_k": -2}}, "top_k"),  # B4
        ({"prompt": "x", "sampling": {"min_p": 1.5}}, "min_p"),  # B4
        ({"prompt": "x", "sampling": {"presence_penalty": 3}}, "presence_penalty"),  # B4
        ({"prompt": "x", "sampling": {"logprobs": 21}}, "logprobs"),  # B4
        ({"prompt": "x", "sampling": {"stop": [""]}}, "stop"),  # B4
        ({"prompt": "x", "request_id": "bad id!"}, "request_id"),
    ],
)
def test_grpc_bad_input_is_invalid_argument_naming_the_field(
    parser: RequestParser, request_kw: dict, field: str
) -> None:
    code, message = code_of(parser.from_grpc, grpc_req(**request_kw))
    assert code == ErrorCode.INVALID_ARGUMENT
    assert message.startswith(field), message


def test_b2_boundaries_at_the_context_length(parser: RequestParser) -> None:
    for n, ok in ((CTX - 2, True), (CTX - 1, True), (CTX, False), (CTX + 1, False)):
        req = grpc_req(token_ids=pb.TokenIds(ids=[1] * n), sampling={"max_tokens": 1})
        if ok:
            assert len(parser.from_grpc(req).prompt_token_ids) == n
        else:
            code, message = code_of(parser.from_grpc, req)
            assert code == ErrorCode.INVALID_ARGUMENT and str(n) in message
    # prompt + max_tokens over the context names both lengths
    req = grpc_req(token_ids=pb.TokenIds(ids=[1] * 100), sampling={"max_tokens": 29})
    code, message = code_of(parser.from_grpc, req)
    assert code == ErrorCode.INVALID_ARGUMENT and "100" in message and "29" in message


def test_b9_deadline_passed_or_capped(parser: RequestParser) -> None:
    code, _ = code_of(parser.from_grpc, grpc_req(prompt="x", timeout_ms=0))
    assert code == ErrorCode.DEADLINE_EXCEEDED
    p = parser.from_grpc(grpc_req(prompt="x", timeout_ms=1500))
    assert p.deadline is not None and 1.0 < p.deadline - time.time() <= 1.5


@settings(max_examples=300, deadline=None)
@given(
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=64),
    top_p=st.floats(allow_nan=True, allow_infinity=True, width=64),
    top_k=st.integers(-(2**40), 2**40),
    logprobs=st.integers(-5, 40),
)
def test_b4_generated_params_valid_or_invalid_argument(
    temperature: float, top_p: float, top_k: int, logprobs: int
) -> None:
    parser = RequestParser(
        FakeTokenizer(VOCAB), ModelLimits(CTX, VOCAB), "m", BLOCK, RouterConfig()
    )
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "logprobs": logprobs}
    valid = 0 <= temperature <= 2 and 0 < top_p <= 1 and top_k >= -1 and 0 <= logprobs <= 20
    try:
        p = parser.from_grpc(grpc_req(prompt="a b", sampling=sampling))
    except PDServeError as e:
        assert not valid and e.code == ErrorCode.INVALID_ARGUMENT
        assert e.message.split(":")[0] in sampling
    else:
        assert valid and p.params.top_k == top_k


# -- OpenAI --------------------------------------------------------------------------------------


def test_completion_fields_map_onto_sampling(parser: RequestParser) -> None:
    p = parser.from_completion(
        {
            "model": "m",
            "prompt": "a b c",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "x",
            "n": 1,
            "logprobs": 2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "user": "u",
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 4,
        }
    )
    assert p.kind == "completion" and p.stream and p.include_usage
    assert p.request_id.startswith("cmpl-")
    assert p.params == SamplingParams(
        max_tokens=7,
        temperature=0.0,
        top_p=0.5,
        seed=3,
        stop=("x",),
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        top_k=4,
    )


def test_completion_prompt_forms(parser: RequestParser) -> None:
    assert parser.from_completion({"prompt": [5, 6, 7]}).prompt_token_ids == [5, 6, 7]
    assert parser.from_completion({"prompt": [[5, 6]]}).prompt_token_ids == [5, 6]
    assert parser.from_completion({"prompt": ["t5 t6"]}).prompt_token_ids == [5, 6]
    assert parser.from_completion({"prompt": "t5"}).params.max_tokens == 16  # OpenAI default
    code, message = code_of(parser.from_completion, {"prompt": ["a", "b"]})
    assert code == ErrorCode.INVALID_ARGUMENT and "batched" in message


def test_chat_defaults_and_logprobs(parser: RequestParser) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    p = parser.from_chat(body)
    assert p.kind == "chat" and not p.stream
    assert p.params.max_tokens == CTX - len(p.prompt_token_ids)  # as many as the context allows
    assert p.params.logprobs is None
    p = parser.from_chat({**body, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 4})
    assert p.params.logprobs == 3 and p.params.max_tokens == 4
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    p2 = parser.from_chat({"messages": [{"role": "user", "content": parts}]})
    assert p2.prompt_token_ids == parser.from_chat(body).prompt_token_ids


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"prompt": "x", "tools": [{"type": "function"}]}, ErrorCode.INVALID_ARGUMENT, "tools"),
        ({"prompt": "x", "response_format": {"type": "grammar"}}, None, "response_format"),
        ({"prompt": "x", "n": 0}, ErrorCode.INVALID_ARGUMENT, "n"),
        ({"prompt": "x", "n": 17}, ErrorCode.INVALID_ARGUMENT, "n"),
        ({"prompt": "x", "n": 2, "best_of": 1}, ErrorCode.INVALID_ARGUMENT, "best_of"),
        ({"prompt": "x", "best_of": 3, "stream": True}, ErrorCode.INVALID_ARGUMENT, "best_of"),
        ({"prompt": "x", "logit_bias": [1]}, ErrorCode.INVALID_ARGUMENT, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, ErrorCode.INVALID_ARGUMENT, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": "1"}}, ErrorCode.INVALID_ARGUMENT, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, ErrorCode.INVALID_ARGUMENT, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"600": 1}}, ErrorCode.INVALID_ARGUMENT, "logit_bias"),
        ({"prompt": "x", "include_stop_str_in_output": 1}, None, "include_stop_str_in_output"),
        ({"prompt": "x", "frobnicate": 1}, ErrorCode.INVALID_ARGUMENT, "frobnicate"),
        ({"prompt": "x", "model": "gpt-4"}, ErrorCode.NOT_FOUND, "model"),
        ({"prompt": "x", "max_tokens": "7"}, ErrorCode.INVALID_ARGUMENT, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, ErrorCode.INVALID_ARGUMENT, "temperature"),
        ({"prompt": "x", "temperature": True}, ErrorCode.INVALID_ARGUMENT, "temperature"),
        ({"prompt": "x", "stop": [1]}, ErrorCode.INVALID_ARGUMENT, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, None, "stream_options"),
        ({"prompt": "x", "stream": "yes"}, ErrorCode.INVALID_ARGUMENT, "stream"),
        ({"prompt": ""}, ErrorCode.INVALID_ARGUMENT, "prompt"),
        ({}, ErrorCode.INVALID_ARGUMENT, "prompt"),
        ({"prompt": [1, VOCAB + 3]}, ErrorCode.INVALID_ARGUMENT, "prompt_token_ids"),
        ({"prompt": "x", "max_tokens": CTX}, ErrorCode.INVALID_ARGUMENT, "max_tokens"),
    ],
)
def test_completion_bad_input(
    parser: RequestParser, body: dict, code: ErrorCode | None, field: str
) -> None:
    got, message = code_of(parser.from_completion, body)
    assert got == (code or ErrorCode.INVALID_ARGUMENT)
    assert message.startswith(field), message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, "n"),
    ],
)
def test_chat_bad_input(parser: RequestParser, body: dict, field: str) -> None:
    code, message = code_of(parser.from_chat, body)
    assert code == ErrorCode.INVALID_ARGUMENT
    assert message.startswith(field), message


def test_a_client_request_id_is_a_label_the_cluster_id_is_unique(parser: RequestParser) -> None:
    """K10: two requests with one client id reach the pools under two ids (each with the label
    in it, for the logs); replies carry the label; a made-up id needs no suffix."""
    a = parser.from_grpc(grpc_req(prompt="hi", request_id="same"))
    b = parser.from_completion({"prompt": "hi", "request_id": "same"})
    assert a.request_id == b.request_id == "same"
    assert len({a.call_id, b.call_id}) == 2
    assert all(c.startswith("same@") for c in (a.call_id, b.call_id))
    assert a.to_call(0.0).request_id == a.call_id
    made = parser.from_grpc(grpc_req(prompt="hi"))
    assert made.call_id == made.request_id and made.request_id.startswith("req-")
    for bad in ("a@b", "x\n", "é"):  # '@' never appears in a label: ids cannot collide
        assert code_of(parser.from_grpc, grpc_req(prompt="hi", request_id=bad))[0] == (
            ErrorCode.INVALID_ARGUMENT
        )


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    """B10: the cheap bound: no token covers more than ``max_chars_per_token`` characters, so a
    longer text than ``max_model_len`` of them is refused without calling the tokenizer."""

    class Bounded(FakeTokenizer):
        max_chars_per_token = 4
        calls = 0

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            Bounded.calls += 1
            return super().encode(text, add_special_tokens)

    p = RequestParser(Bounded(VOCAB), ModelLimits(CTX, VOCAB), "m", BLOCK, RouterConfig())
    for request in (
        lambda: p.from_completion({"prompt": "x" * (4 * CTX + 1)}),
        lambda: p.from_grpc(grpc_req(prompt="y" * (4 * CTX + 1))),
        lambda: p.from_chat({"messages": [{"role": "user", "content": "z" * (4 * CTX + 1)}]}),
    ):
        code, message = code_of(request)
        assert code == ErrorCode.INVALID_ARGUMENT and "cannot fit" in message, message
    assert Bounded.calls == 0
    # at the bound itself the tokenizer decides (here: one word, one token)
    assert p.from_completion({"prompt": "x" * (4 * CTX), "max_tokens": 1}).prompt_token_ids
    assert Bounded.calls == 1


def test_n_best_of_echo_logit_bias_and_stop_strings_map_onto_the_call(
    parser: RequestParser,
) -> None:
    p = parser.from_completion(
        {
            "prompt": "t5 t6",
            "n": 2,
            "best_of": 4,
            "echo": True,
            "logit_bias": {"7": 5, "9": -100},
            "stop": ["t9"],
            "include_stop_str_in_output": True,
        }
    )
    assert (p.n, p.best_of, p.echo) == (2, 4, "t5 t6")
    assert p.to_call(0.0).n == 4  # best_of samples are generated; n are returned
    assert p.params.logprobs == 0 and not p.client_logprobs  # ranking needs them, not shown
    assert p.params.logit_bias == ((7, 5.0), (9, -100.0))
    assert p.params.include_stop_str_in_output
    chat = parser.from_chat({"messages": [{"role": "user", "content": "x"}], "n": 3})
    assert (chat.n, chat.to_call(0.0).n, chat.params.logprobs) == (3, 3, None)
    g = parser.from_grpc(
        grpc_req(prompt="hi", sampling={"n": 5, "logit_bias": {3: 1.5}, "seed": 1})
    )
    assert g.to_call(0.0).n == 5 and g.params.logit_bias == ((3, 1.5),)
    assert code_of(parser.from_grpc, grpc_req(prompt="hi", sampling={"n": 0}))[1].startswith("n:")
    ids = parser.from_completion({"prompt": [5, 6], "echo": True})
    assert ids.echo == " t5 t6"  # token ids echo as their text
    assert ids.params.prompt_logprobs is None
    scored = parser.from_completion({"prompt": [5, 6], "echo": True, "logprobs": 2})
    assert (scored.params.prompt_logprobs, scored.params.logprobs) == (2, 2)
    plain = parser.from_completion({"prompt": [5, 6], "logprobs": 2})
    assert plain.params.prompt_logprobs is None  # without echo the prompt's are not computed


def test_tokenize_and_detokenize(parser: RequestParser) -> None:
    got = parser.tokenize({"prompt": "t5 t6 t7"})
    assert got == {"tokens": [5, 6, 7], "count": 3, "max_model_len": CTX}
    chat = parser.tokenize({"messages": [{"role": "user", "content": "hi"}]})
    assert (
        chat["tokens"]
        == parser.from_chat({"messages": [{"role": "user", "content": "hi"}]}).prompt_token_ids
    )
    assert parser.detokenize({"tokens": [5, 6]}) == {"prompt": " t5 t6"}
    assert parser.detokenize({"tokens": [0, 5], "skip_special_tokens": True}) == {"prompt": " t5"}
    for fn, body, field in [
        (parser.tokenize, {}, "prompt"),
        (parser.tokenize, {"prompt": "x", "messages": []}, "prompt"),
        (parser.tokenize, {"prompt": 5}, "prompt"),
        (parser.tokenize, {"messages": "x"}, "messages"),
        (parser.tokenize, {"prompt": "x", "stream": True}, "stream"),
        (parser.detokenize, {"tokens": [VOCAB]}, "tokens"),
        (parser.detokenize, {"tokens": "5"}, "tokens"),
        (parser.detokenize, {"tokens": [True]}, "tokens"),
    ]:
        code, message = code_of(fn, body)
        assert code == ErrorCode.INVALID_ARGUMENT and message.startswith(field), message
    assert code_of(parser.detokenize, {"tokens": [1], "model": "x"})[0] == ErrorCode.NOT_FOUND


# -- hostile numbers and quotes (issue 40, item 3) ----------------------------------------------

NUMERIC_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "timeout_ms",
    "min_tokens",
)


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
@pytest.mark.parametrize("digits", [40, 400, 5000])
def test_a_huge_number_in_any_field_is_a_400_naming_it(
    parser: RequestParser, field: str, digits: int
) -> None:
    """JSON takes integers of up to 4,300 digits: one of 400 overflowed a float conversion (a
    500), one of 5,000 failed int() itself; the error quoted all of them back."""
    from cluster.router.requests import json_object

    for sign in ("", "-"):
        raw = f'{{"prompt": "x", "{field}": {sign}{"7" * digits}}}'.encode()
        code, message = code_of(lambda body: parser.from_completion(json_object(body)), raw)
        assert code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.DEADLINE_EXCEEDED), message
        assert len(message) < 200, message
        assert message.startswith("body:") or message.startswith(field), message


@pytest.mark.parametrize("digits", [13, 400, 5000])
def test_a_logit_bias_key_of_many_digits_is_a_400(parser: RequestParser, digits: int) -> None:
    code, message = code_of(
        parser.from_completion, {"prompt": "x", "logit_bias": {"9" * digits: 1}}
    )
    assert code == ErrorCode.INVALID_ARGUMENT and message.startswith("logit_bias"), message
    assert len(message) < 200, message


def test_client_text_quoted_in_an_error_is_clipped(parser: RequestParser) -> None:
    """An unknown field, a model or a logit_bias key of a MiB is named, not echoed whole (into
    the answer and the router's log)."""
    huge = "k" * (1 << 20)
    for body in (
        {"prompt": "x", huge: 1},
        {"prompt": "x", "model": huge},
        {"prompt": "x", "logit_bias": {huge: 1}},
    ):
        _code, message = code_of(parser.from_completion, body)
        assert len(message) < 1000 and "characters)" in message, message[:400]


def test_sampling_params_refuse_a_huge_integer_as_a_value_error() -> None:
    """The engine's own check (Python API, YAML): a ValueError naming the field, not the
    OverflowError of a float conversion."""
    for field in ("temperature", "top_p", "min_p", "presence_penalty"):
        with pytest.raises(ValueError, match=f"^{field}: out of range"):
            SamplingParams(**{field: 10**400})
