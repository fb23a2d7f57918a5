"""The fields common clients send (OpenAI's and vLLM's extensions), one test each: implemented,
or accepted and ignored where they cannot change the output, or refused naming the field
(docs/api/openai.md, "Request fields")."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import StreamChunk, Usage
from cluster.common.tokenizer import FakeTokenizer
from cluster.config import RouterConfig
from cluster.config.model_paths import ModelLimits
from cluster.router.requests import ParsedRequest, RequestParser
from cluster.router.responses import ChatStream, CompletionStream

VOCAB = 512
TOK = FakeTokenizer(VOCAB)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def parser() -> RequestParser:
    return RequestParser(TOK, ModelLimits(256, VOCAB), "m", 16, RouterConfig())


def refused(fn: Any, body: dict[str, Any]) -> str:
    with pytest.raises(PDServeError) as info:
        fn(body)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    return info.value.message


def chat(parser: RequestParser, **body: Any) -> ParsedRequest:
    return parser.from_chat({"messages": CHAT, **body})


def completion(parser: RequestParser, **body: Any) -> ParsedRequest:
    return parser.from_completion({"prompt": "t1 t2 t3", **body})


# -- what GuideLLM sends on every streamed request -------------------------------------------


def test_guidellm_body_is_accepted(parser: RequestParser) -> None:
    body = {
        "prompt": "t1 t2 t3",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": None,
        "ignore_eos": True,
    }
    p = parser.from_completion(body)
    assert p.include_usage and p.continuous_usage and p.params.ignore_eos
    assert p.params.stop == () and p.params.max_tokens == 4


def _stream(p: ParsedRequest, fmt_type: type) -> list[dict[str, Any]]:
    usage = Usage(3, 3, 1, "remote")
    parts = [
        StreamChunk("r", [7], " t7"),
        StreamChunk("r", [8, 9], " t8 t9"),
        StreamChunk("r", [], "", None, None, "length", usage),
    ]
    fmt = fmt_type(p, "m", TOK)
    events = [e for c in parts for e in fmt.events(c)] + list(fmt.finish())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_stats_puts_the_count_so_far_on_every_chunk(
    parser: RequestParser, include_usage: bool
) -> None:
    opts = {"include_usage": include_usage, "continuous_usage_stats": True}
    payloads = _stream(completion(parser, stream=True, stream_options=opts), CompletionStream)
    with_choices = [x for x in payloads if x["choices"]]
    assert [x["usage"]["completion_tokens"] for x in with_choices] == [1, 3, 3]
    assert all(x["usage"]["prompt_tokens"] == 3 for x in with_choices)
    assert all(x["usage"]["total_tokens"] == 3 + x["usage"]["completion_tokens"] for x in payloads)
    assert with_choices[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}  # final
    # include_usage adds OpenAI's usage-only last chunk; without it there is none.
    assert (payloads[-1]["choices"] == []) == include_usage


def test_continuous_usage_on_chat_parses_with_openai_types(parser: RequestParser) -> None:
    opts = {"continuous_usage_stats": True}
    payloads = _stream(chat(parser, stream=True, stream_options=opts), ChatStream)
    chunks = [ChatCompletionChunk.model_validate(x) for x in payloads]
    assert chunks[0].usage is not None and chunks[0].usage.completion_tokens == 0  # the role
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [0, 1, 3, 3]


def test_stream_options_other_keys_are_refused(parser: RequestParser) -> None:
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}
    assert refused(parser.from_completion, body).startswith("include_usage")
    body["stream_options"] = {"chunk_usage": True}
    assert refused(parser.from_completion, body).startswith("stream_options.chunk_usage")


# -- sampling extensions (implemented) -------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("ignore_eos", True, "ignore_eos"),
        ("min_tokens", 2, "min_tokens"),
        ("top_k", 5, "top_k"),
        ("min_p", 0.1, "min_p"),
        ("repetition_penalty", 1.2, "repetition_penalty"),
        ("skip_special_tokens", False, "skip_special_tokens"),
    ],
)
def test_sampling_extensions_reach_the_engine(
    parser: RequestParser, field: str, value: Any, param: str
) -> None:
    for p in (chat(parser, **{field: value}), completion(parser, **{field: value})):
        assert getattr(p.params, param) == value
    assert refused(parser.from_completion, {"prompt": "x", field: "bad"}).startswith(field)


def test_max_completion_tokens_wins_over_max_tokens(parser: RequestParser) -> None:
    assert chat(parser, max_completion_tokens=5).params.max_tokens == 5
    assert chat(parser, max_completion_tokens=5, max_tokens=9).params.max_tokens == 5
    assert chat(parser, max_tokens=9).params.max_tokens == 9


def test_stop_null_is_no_stop(parser: RequestParser) -> None:
    assert chat(parser, stop=None).params.stop == ()
    assert completion(parser, stop=None).params.stop == ()


def test_spaces_between_special_tokens(parser: RequestParser) -> None:
    """It only matters when special tokens are kept: then only ``false`` (how the tokenizer
    joins them) is what pdserve does; ``true`` is refused instead of being ignored."""
    for value in (True, False):
        assert completion(parser, spaces_between_special_tokens=value).params.skip_special_tokens
    kept = completion(parser, spaces_between_special_tokens=False, skip_special_tokens=False)
    assert kept.params.skip_special_tokens is False
    body = {"prompt": "x", "spaces_between_special_tokens": True, "skip_special_tokens": False}
    assert refused(parser.from_completion, body).startswith("spaces_between_special_tokens")


# -- chat template options (implemented) -----------------------------------------------------


def test_add_generation_prompt(parser: RequestParser) -> None:
    assert chat(parser).prompt_token_ids == TOK.encode_chat(CHAT)
    off = chat(parser, add_generation_prompt=False).prompt_token_ids
    assert off == TOK.encode_chat(CHAT, add_generation_prompt=False)
    assert off != chat(parser).prompt_token_ids


def test_continue_final_message(parser: RequestParser) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "t5 t6"}]
    p = parser.from_chat(
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    )
    assert p.prompt_token_ids == TOK.encode(TOK.apply_chat_template(messages, False))
    assert p.prompt_token_ids[-2:] == [5, 6]  # ends inside the assistant's message
    # add_generation_prompt defaults to false when the final message is continued
    same = parser.from_chat({"messages": messages, "continue_final_message": True})
    assert same.prompt_token_ids == p.prompt_token_ids
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    assert refused(parser.from_chat, both).startswith("continue_final_message")


def test_chat_template_kwargs_reach_the_template(parser: RequestParser) -> None:
    p = chat(parser, chat_template_kwargs={"enable_thinking": False})
    assert p.prompt_token_ids == TOK.encode_chat(CHAT, template_kwargs={"enable_thinking": False})
    assert p.prompt_token_ids != chat(parser).prompt_token_ids
    for bad in ([1], {"messages": []}, {"not a name": 1}):
        body = {"messages": CHAT, "chat_template_kwargs": bad}
        assert refused(parser.from_chat, body).startswith("chat_template_kwargs")


# -- metadata (accepted, ignored) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "bad"),
    [
        ("user", "u-1", 7),
        ("metadata", {"team": "a"}, {"team": 1}),
        ("service_tier", "auto", 3),
    ],
)
def test_metadata_fields_are_accepted_and_change_nothing(
    parser: RequestParser, field: str, value: Any, bad: Any
) -> None:
    plain = chat(parser)
    with_field = chat(parser, **{field: value})
    assert with_field.params == plain.params
    assert with_field.prompt_token_ids == plain.prompt_token_ids
    assert refused(parser.from_chat, {"messages": CHAT, field: bad}).startswith(field)


def test_parallel_tool_calls_without_tools_is_harmless(parser: RequestParser) -> None:
    assert chat(parser, parallel_tool_calls=True).params == chat(parser).params
    assert chat(parser, parallel_tool_calls=False).params == chat(parser).params
    body = {"messages": CHAT, "parallel_tool_calls": "yes"}
    assert refused(parser.from_chat, body).startswith("parallel_tool_calls")
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": CHAT, "parallel_tool_calls": True, "tools": tools}
    assert refused(parser.from_chat, body).startswith("tools")


def test_an_unknown_field_that_would_change_the_output_is_still_refused(
    parser: RequestParser,
) -> None:
    for field, value in (("guided_regex", "a+"), ("prompt_logprobs", 1), ("truncate", 10)):
        body = {"messages": CHAT, field: value}
        assert refused(parser.from_chat, body).startswith(f"{field}: unsupported field")
