"""Turning a gRPC or OpenAI request into a validated, tokenized ``GenerateCall`` (torch-free).

Everything a client can get wrong is caught here, before any worker is touched, as an
``INVALID_ARGUMENT`` (HTTP 400) whose message names the field: unknown or unsupported fields,
types, ranges, token ids outside the vocabulary, prompt + max_tokens beyond the context.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cluster.common.errors import ErrorCode, PDServeError, invalid
from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall
from cluster.common.sampling_params import (
    MAX_LOGPROBS,
    MAX_SAMPLES,
    SamplingParams,
    validate_prompt,
)
from cluster.config import RouterConfig
from cluster.config.model_paths import ModelLimits
from cluster.router.structured import check_schema, response_format

_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
MAX_PROMPT_CHARS = 4 << 20  # raw text, before tokenization (the body limit applies first)
_MAX_INT_DIGITS = 32  # in any JSON integer of a body (ids and seeds fit in 20)
_MAX_ID_DIGITS = 12  # a token id has fewer digits; int() of 4,300+ digits raises ValueError
_QUOTE_CHARS = 64  # client text quoted in an error (and so in the log) is cut to this

# OpenAI fields, per endpoint: accepted (and mapped), or refused with a message naming them.
_COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "user",
        "stream",
        "stream_options",
        "response_format",  # text, json_object, json_schema (structured output)
        # Extensions (as vLLM and SGLang accept them; the openai client sends them via
        # ``extra_body``).
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "logit_bias",
        "spaces_between_special_tokens",
        "request_id",
        "timeout_ms",
        # Pure metadata: checked for type, never change the output (docs/api/openai.md).
        "metadata",
        "service_tier",
    }
)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "parallel_tool_calls",  # without tools (refused) it changes nothing
}
_UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported",
}


class StreamFlags(NamedTuple):
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: the usage on every chunk


# the fields a tokenizer's chat error may name itself (others are prefixed with "messages")
_CHAT_ERROR_FIELDS = ("messages", "continue_final_message", "chat_template_kwargs")
_GRPC_STREAM = StreamFlags(True, False, False)  # gRPC streams; usage arrives in its own field


class RequestIds(NamedTuple):
    label: str  # what the client sent (or what was made for it): every reply carries it
    unique: str  # the cluster's id of this request, in every pool and every log line


@dataclass(slots=True)
class ParsedRequest:
    """A validated request, ready to send to the decode pool."""

    request_id: str  # the client's id (a label, maybe shared with other requests)
    call_id: str  # unique: the id the pools know the request by
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    deadline: float | None  # wall clock
    kind: str  # "grpc" | "completion" | "chat"
    stream: bool = True
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage: bool = False  # every chunk carries the usage so far
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1  # choices returned
    best_of: int = 1  # samples generated (>= n): the n of highest total logprob are returned
    client_logprobs: bool = True  # False: logprobs only asked for ranking best_of (not shown)
    echo: str | None = None  # completions, echo: the prompt's text, which each choice starts with

    @property
    def num_samples(self) -> int:
        """Sequences the request decodes (what admission counts)."""
        return max(self.n, self.best_of)

    def to_call(self, router_queue_ms: float) -> GenerateCall:
        return GenerateCall(
            request_id=self.call_id,
            prompt_token_ids=self.prompt_token_ids,
            block_hashes=self.block_hashes,
            params=self.params,
            n=self.num_samples,
            deadline=self.deadline,
            router_queue_ms=router_queue_ms,
        )


async def read_body(parts: AsyncIterator[bytes], declared: str | None, limit: int) -> bytes:
    """An HTTP body, read as it arrives and refused (413, PAYLOAD_TOO_LARGE) as soon as it
    passes ``limit``: a chunked body has no Content-Length to check first, and is never
    buffered beyond the limit. Not a 429: the OpenAI SDKs retry those, resending the body."""
    too_big = PDServeError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"request body exceeds {limit} bytes (router.max_request_bytes)",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for part in parts:
        size += len(part)
        if size > limit:
            raise too_big
        chunks.append(part)
    return b"".join(chunks)


class _HugeNumber(Exception):
    def __init__(self, digits: int) -> None:
        self.digits = digits


def _bounded_int(literal: str) -> int:
    """A JSON integer, refused past ``_MAX_INT_DIGITS`` digits: no field takes one that long,
    and one of hundreds of digits overflows a float conversion (a 500) or fills an error."""
    digits = len(literal.lstrip("-"))
    if digits > _MAX_INT_DIGITS:
        raise _HugeNumber(digits)
    return int(literal)


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let surrogates through
    except UnicodeDecodeError as e:
        raise invalid(f"body: not valid UTF-8 (at byte {e.start})") from None
    try:
        body = json.loads(text, parse_int=_bounded_int)
    except _HugeNumber as e:
        raise invalid(f"body: an integer of {e.digits} digits; at most {_MAX_INT_DIGITS}") from None
    except ValueError:
        raise invalid("body: not valid JSON") from None
    except RecursionError:  # a hostile "[[[[...": refused like any bad body, not a 500
        raise invalid("body: not valid JSON (nested too deeply to parse)") from None
    if not isinstance(body, dict):
        raise invalid("body: must be a JSON object")
    return body


def _clip(text: str) -> str:
    """Client text as an error quotes it: never more than ``_QUOTE_CHARS`` characters (a MiB
    field name must not come back in the answer, nor fill the log)."""
    if len(text) <= _QUOTE_CHARS:
        return text
    return f"{text[:_QUOTE_CHARS]}... ({len(text)} characters)"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key}: must be an integer, got {_type_name(value)}")
    return value


def _float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{key}: must be a number, got {_type_name(value)}")
    return float(value)


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{key}: must be true or false, got {_type_name(value)}")
    return value


def utf8_text(text: str, where: str) -> str:
    """``text``, if it is valid Unicode: a JSON string may hold a lone surrogate (``"\\ud800"``),
    which no tokenizer can take and no reply can echo (INVALID_ARGUMENT naming the field)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(
            f"{where}: not valid Unicode (a lone surrogate at character {e.start})"
        ) from None
    return text


def _text_parts(content: Any, where: str) -> str:
    """Chat content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return utf8_text(content, where)
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else _type_name(part)
                raise invalid(
                    f"{where}[{i}]: only text parts are supported, got {_clip(repr(kind))}"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}[{i}].text: must be a string")
            texts.append(utf8_text(text, f"{where}[{i}].text"))
        return "".join(texts)
    raise invalid(f"{where}: must be a string or a list of text parts")


class RequestParser:
    """Validation and tokenization at the router, one per router replica."""

    def __init__(
        self,
        tokenizer: Any,
        limits: ModelLimits,
        model_name: str,
        block_size: int,
        router: RouterConfig,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.model = model_name
        self.block_size = block_size
        self.router = router

    # -- shared --------------------------------------------------------------------------------

    def request_id(self, given: str | None, prefix: str) -> RequestIds:
        """A client's id is a label (two requests may carry the same one); the cluster's own
        id of the request is unique: the label plus a random suffix ('@' is never in a label)."""
        if not given:
            generated = f"{prefix}-{uuid.uuid4().hex}"
            return RequestIds(generated, generated)
        if not isinstance(given, str) or not _REQUEST_ID.fullmatch(given):
            raise invalid(
                "request_id: at most 128 letters, digits, '-', '_', '.' or ':' characters"
            )
        return RequestIds(given, f"{given}@{uuid.uuid4().hex[:16]}")

    def deadline(self, timeout_ms: int | None) -> float:
        if timeout_ms is None:
            return time.time() + self.router.request_timeout_s
        if timeout_ms <= 0:
            raise PDServeError(ErrorCode.DEADLINE_EXCEEDED, "timeout_ms: the deadline has passed")
        return time.time() + min(timeout_ms / 1000, self.router.request_timeout_s)

    def _check_chars(self, num_chars: int, field_name: str) -> None:
        """The cheap bound, before any tokenizing (B10): a text longer than any prompt the
        context can hold (``max_model_len`` x the longest token) cannot fit."""
        if num_chars > MAX_PROMPT_CHARS:
            raise invalid(f"{field_name}: longer than {MAX_PROMPT_CHARS} characters")
        per_token = getattr(self.tokenizer, "max_chars_per_token", None)
        if per_token and num_chars > self.limits.max_model_len * per_token:
            raise invalid(
                f"{field_name}: {num_chars} characters cannot fit in max_model_len="
                f"{self.limits.max_model_len} tokens (at most "
                f"{self.limits.max_model_len * per_token} characters)"
            )

    def encode_text(self, text: str, field_name: str) -> list[int]:
        self._check_chars(len(text), field_name)
        if not text:
            raise invalid("prompt: prompt cannot be empty")
        return list(self.tokenizer.encode(utf8_text(text, field_name)))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """The chat's prompt ids; ``options``: the tokenizer's chat options (``_chat_options``)."""
        self._check_chars(
            sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, Mapping)),
            "messages",
        )
        try:
            return list(self.tokenizer.encode_chat(messages, **options))
        except ValueError as e:  # includes ChatTemplateError, raised by the model's template
            named = str(e).startswith(_CHAT_ERROR_FIELDS)
            raise invalid(str(e) if named else f"messages: {e}") from None

    def finish(
        self,
        ids: RequestIds,
        prompt: list[int],
        params: SamplingParams,
        deadline: float | None,
        kind: str,
        flags: StreamFlags = _GRPC_STREAM,
    ) -> ParsedRequest:
        try:
            validate_prompt(
                prompt,
                params,
                vocab_size=self.limits.vocab_size,
                max_model_len=self.limits.max_model_len,
            )
        except ValueError as e:
            raise invalid(str(e)) from None
        return ParsedRequest(
            request_id=ids.label,
            call_id=ids.unique,
            prompt_token_ids=prompt,
            block_hashes=hash_block_tokens(prompt, self.block_size),
            params=params,
            deadline=deadline,
            kind=kind,
            stream=flags.stream,
            include_usage=flags.include_usage,
            continuous_usage=flags.continuous_usage,
        )

    @staticmethod
    def params(**kwargs: Any) -> SamplingParams:
        try:
            return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
        except ValueError as e:
            raise invalid(str(e)) from None

    # -- gRPC ----------------------------------------------------------------------------------

    def from_grpc(self, request: Any) -> ParsedRequest:
        rid = self.request_id(request.request_id, "req")
        which = request.WhichOneof("input")
        if which is None:
            raise invalid("prompt: prompt cannot be empty (set prompt, token_ids or messages)")
        if which == "prompt":
            prompt = self.encode_text(request.prompt, "prompt")
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            prompt = self.encode_chat(messages)
        s = request.sampling

        def opt(name: str) -> Any:
            return getattr(s, name) if s.HasField(name) else None

        params = self.params(
            max_tokens=opt("max_tokens"),
            min_tokens=opt("min_tokens"),
            temperature=opt("temperature"),
            top_p=opt("top_p"),
            top_k=opt("top_k"),
            min_p=opt("min_p"),
            repetition_penalty=opt("repetition_penalty"),
            presence_penalty=opt("presence_penalty"),
            frequency_penalty=opt("frequency_penalty"),
            seed=opt("seed"),
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=opt("ignore_eos"),
            logprobs=opt("logprobs"),
            logit_bias=tuple(s.logit_bias.items()),
            include_stop_str_in_output=opt("include_stop_str_in_output"),
            json_schema=(
                check_schema(s.json_schema, "json_schema", self.router.max_json_schema_bytes)
                if s.HasField("json_schema")
                else None
            ),
        )
        n = 1 if opt("n") is None else opt("n")
        if not 1 <= n <= MAX_SAMPLES:
            raise invalid(f"n: must be in [1, {MAX_SAMPLES}], got {n}")
        timeout = request.timeout_ms if request.HasField("timeout_ms") else None
        parsed = self.finish(rid, prompt, params, self.deadline(timeout), "grpc")
        parsed.n = parsed.best_of = n
        return parsed

    # -- OpenAI --------------------------------------------------------------------------------

    def _check_fields(self, body: Mapping[str, Any], allowed: frozenset[str]) -> None:
        for key in body:
            utf8_text(key, "body: a field name")
            if key in _UNSUPPORTED and body[key] not in (None, [], {}):
                raise invalid(f"{key}: {_UNSUPPORTED[key]}")
            if key not in allowed and key not in _UNSUPPORTED:
                raise invalid(
                    f"{_clip(key)}: unsupported field; supported: {', '.join(sorted(allowed))}"
                )
        self._check_model(body)
        if body.get("suffix"):
            raise invalid("suffix: insertion (suffix) is not supported")

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise PDServeError(
                ErrorCode.NOT_FOUND,
                f"model: {_clip(repr(model))} is not served here; "
                f"this cluster serves {self.model!r}",
            )

    @staticmethod
    def _samples(body: Mapping[str, Any], stream: bool) -> tuple[int, int]:
        """(n, best_of): choices returned, samples generated."""
        n = _int(body, "n")
        n = 1 if n is None else n
        if not 1 <= n <= MAX_SAMPLES:
            raise invalid(f"n: must be in [1, {MAX_SAMPLES}], got {n}")
        best_of = _int(body, "best_of")
        best_of = n if best_of is None else best_of
        if not n <= best_of <= MAX_SAMPLES:
            raise invalid(f"best_of: must be in [n={n}, {MAX_SAMPLES}], got {best_of}")
        if stream and best_of > n:
            raise invalid("best_of: cannot be streamed when greater than n (stream: false)")
        return n, best_of

    def _stream_flags(self, body: Mapping[str, Any]) -> StreamFlags:
        stream = bool(_bool(body, "stream"))
        opts = body.get("stream_options")
        if opts is None:
            return StreamFlags(stream, False, False)
        if not isinstance(opts, Mapping):
            raise invalid("stream_options: must be an object")
        if not stream:
            raise invalid("stream_options: only allowed when stream is true")
        supported = ("include_usage", "continuous_usage_stats")
        unknown = sorted(set(opts) - set(supported))
        if unknown:
            raise invalid(
                f"stream_options.{unknown[0]}: unsupported; supported: {', '.join(supported)}"
            )
        include = _bool(opts, "include_usage")
        continuous = _bool(opts, "continuous_usage_stats")
        return StreamFlags(stream, bool(include), bool(continuous))

    @staticmethod
    def _metadata(body: Mapping[str, Any]) -> None:
        """Fields that never change the output, checked for their type only."""
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, Mapping) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise invalid("metadata: must be an object mapping keys to strings")
        for key in ("service_tier", "user"):
            value = body.get(key)
            if value is not None and not isinstance(value, str):
                raise invalid(f"{key}: must be a string, got {_type_name(value)}")
            if value is not None:
                utf8_text(value, key)

    def _stop(self, body: Mapping[str, Any]) -> tuple[str, ...]:
        stop = body.get("stop")
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (utf8_text(stop, "stop"),)
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return tuple(utf8_text(s, f"stop[{i}]") for i, s in enumerate(stop))
        raise invalid("stop: must be a string or a list of strings")

    def _common_params(
        self, body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None and not (
            isinstance(stop_ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)
        ):
            raise invalid("stop_token_ids: must be a list of integers")
        self._metadata(body)
        skip = _bool(body, "skip_special_tokens")
        if _bool(body, "spaces_between_special_tokens") and skip is False:
            raise invalid(
                "spaces_between_special_tokens: true is not supported with "
                "skip_special_tokens: false (special tokens are joined as the tokenizer "
                "decodes them); with special tokens skipped it changes nothing"
            )
        return self.params(
            max_tokens=max_tokens,
            min_tokens=_int(body, "min_tokens"),
            temperature=_float(body, "temperature"),
            top_p=_float(body, "top_p"),
            top_k=_int(body, "top_k"),
            min_p=_float(body, "min_p"),
            repetition_penalty=_float(body, "repetition_penalty"),
            presence_penalty=_float(body, "presence_penalty"),
            frequency_penalty=_float(body, "frequency_penalty"),
            seed=_int(body, "seed"),
            stop=self._stop(body),
            stop_token_ids=tuple(stop_ids or ()),
            ignore_eos=_bool(body, "ignore_eos"),
            skip_special_tokens=skip,
            logprobs=logprobs,
            logit_bias=self._logit_bias(body),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
            json_schema=response_format(
                body.get("response_format"), self.router.max_json_schema_bytes
            ),
        )

    @staticmethod
    def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...] | None:
        """OpenAI's ``{"token id": bias}`` map (JSON keys are strings)."""
        bias = body.get("logit_bias")
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise invalid("logit_bias: must be an object mapping token ids to biases")
        out = []
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise invalid(f"logit_bias: keys must be token ids, got {_clip(repr(key))}")
            if len(key) > _MAX_ID_DIGITS:  # int() of 4,300+ digits raises; none is a token id
                raise invalid(f"logit_bias: key of {len(key)} digits is not a token id")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise invalid(f"logit_bias: the bias of {key} must be a number")
            out.append((int(key), float(value)))
        return tuple(out)

    def _completion_prompt(self, prompt: Any) -> list[int]:
        # A string, a list of token ids, or a batch of exactly one of either.
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode_text(prompt, "prompt")
        if isinstance(prompt, list):
            if not prompt:
                raise invalid("prompt: prompt cannot be empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            if all(isinstance(p, str | list) for p in prompt):
                raise invalid("prompt: batched prompts are not supported; send one per request")
            raise invalid("prompt: must be a string or a list of token ids")
        if prompt is None:
            raise invalid("prompt: prompt cannot be empty")
        raise invalid(f"prompt: must be a string or a list of token ids, got {_type_name(prompt)}")

    def _max_tokens(self, value: int | None, prompt_len: int) -> int:
        if value is not None:
            return value
        # OpenAI's chat default: as many as the context allows.
        return max(1, self.limits.max_model_len - prompt_len)

    def from_completion(self, body: Mapping[str, Any]) -> ParsedRequest:
        self._check_fields(body, _COMPLETION_FIELDS)
        rid = self.request_id(body.get("request_id"), "cmpl")
        flags = self._stream_flags(body)
        n, best_of = self._samples(body, flags.stream)
        logprobs = _int(body, "logprobs")
        echo = bool(_bool(body, "echo"))
        prompt = self._completion_prompt(body.get("prompt"))
        max_tokens = _int(body, "max_tokens")
        # best_of ranks samples by their total logprob: asked for, if the client did not.
        ranked = 0 if logprobs is None and best_of > n else logprobs
        params = self._common_params(body, 16 if max_tokens is None else max_tokens, ranked)
        if echo and logprobs is not None:  # the prompt's logprobs too (engine: prompt_logprobs)
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        deadline = self.deadline(_int(body, "timeout_ms"))
        parsed = self.finish(rid, prompt, params, deadline, "completion", flags)
        parsed.n, parsed.best_of = n, best_of
        if echo:
            raw = body.get("prompt")
            raw = (
                raw[0]
                if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str)
                else raw
            )
            parsed.echo = raw if isinstance(raw, str) else self.tokenizer.decode(prompt, False)
        parsed.client_logprobs = logprobs is not None
        return parsed

    @staticmethod
    def _messages(messages: Any) -> list[dict[str, Any]]:
        """Chat messages, checked, as the template takes them (text parts joined)."""
        if not isinstance(messages, list) or not messages:
            raise invalid("messages: must be a non-empty list of {role, content} objects")
        flat = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise invalid(f"messages[{i}]: must be an object with role and content")
            for key in m:
                utf8_text(key, f"messages[{i}]: a field name")
            extra = sorted(set(m) - {"role", "content", "name"})
            if extra:
                raise invalid(f"messages[{i}].{extra[0]}: unsupported message field")
            role = m.get("role")
            for key in ("role", "name"):
                if isinstance(m.get(key), str):
                    utf8_text(m[key], f"messages[{i}].{key}")
            flat.append(
                {
                    "role": role,
                    "content": _text_parts(m.get("content"), f"messages[{i}].content"),
                }
            )
        return flat

    @staticmethod
    def _chat_options(body: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's chat extensions: ``add_generation_prompt`` (default true),
        ``continue_final_message``, ``chat_template_kwargs`` (extra template variables)."""
        add = _bool(body, "add_generation_prompt")
        cont = bool(_bool(body, "continue_final_message"))
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise invalid("chat_template_kwargs: must be an object of template variables")
        return {
            "add_generation_prompt": (not cont) if add is None else add,
            "continue_final_message": cont,
            "template_kwargs": dict(kwargs or {}),
        }

    def from_chat(self, body: Mapping[str, Any]) -> ParsedRequest:
        self._check_fields(body, _CHAT_FIELDS)
        rid = self.request_id(body.get("request_id"), "chatcmpl")
        flags = self._stream_flags(body)
        n, _ = self._samples(body, flags.stream)
        _bool(body, "parallel_tool_calls")  # a type check: without tools it changes nothing
        prompt = self.encode_chat(self._messages(body.get("messages")), **self._chat_options(body))
        want_logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not want_logprobs:
            raise invalid("top_logprobs: requires logprobs: true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise invalid(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}")
        logprobs = (top or 0) if want_logprobs else None
        limit = _int(body, "max_completion_tokens")
        if limit is None:
            limit = _int(body, "max_tokens")
        params = self._common_params(body, self._max_tokens(limit, len(prompt)), logprobs)
        deadline = self.deadline(_int(body, "timeout_ms"))
        parsed = self.finish(rid, prompt, params, deadline, "chat", flags)
        parsed.n = parsed.best_of = n
        return parsed

    # -- /tokenize and /detokenize -------------------------------------------------------------

    def tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A prompt (text) or chat messages -> the token ids a request would be given."""
        self._only(body, {"model", "prompt", "messages", "add_special_tokens"})
        if ("prompt" in body) == ("messages" in body):
            raise invalid("prompt: send exactly one of prompt (text) or messages")
        if "messages" in body:
            ids = self.encode_chat(self._messages(body["messages"]))
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise invalid(f"prompt: must be a string, got {_type_name(prompt)}")
            self._check_chars(len(prompt), "prompt")
            special = _bool(body, "add_special_tokens")
            text = utf8_text(prompt, "prompt")
            ids = list(self.tokenizer.encode(text, add_special_tokens=special is not False))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.limits.max_model_len}

    def detokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Token ids -> their text (special tokens kept unless skip_special_tokens)."""
        self._only(body, {"model", "tokens", "skip_special_tokens"})
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or len(tokens) > self.limits.max_model_len:
            raise invalid(f"tokens: must be a list of at most {self.limits.max_model_len} ids")
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.limits.vocab_size:
                raise invalid(
                    f"tokens: {t!r} at position {i} is outside the vocabulary "
                    f"[0, {self.limits.vocab_size})"
                )
        skip = bool(_bool(body, "skip_special_tokens"))
        return {"prompt": self.tokenizer.decode(tokens, skip)}

    def _only(self, body: Mapping[str, Any], allowed: set[str]) -> None:
        for key in body:
            utf8_text(key, "body: a field name")
            if key not in allowed:
                raise invalid(
                    f"{_clip(key)}: unsupported field; supported: {', '.join(sorted(allowed))}"
                )
        self._check_model(body)
