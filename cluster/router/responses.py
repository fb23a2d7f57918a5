"""Rendering the decode pool's ``StreamChunk``s for each API: gRPC messages, OpenAI JSON and SSE.

The OpenAI shapes follow the public API reference (``text_completion``, ``chat.completion``,
``chat.completion.chunk``, the error object), so the official client parses them unchanged;
``usage`` carries pdserve's extras (prefill mode, per-phase times) in an extra ``pdserve`` key.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import StreamChunk, Usage
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.requests import ParsedRequest

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}

_GRPC_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.PAYLOAD_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


# -- gRPC -------------------------------------------------------------------------------------


def grpc_status(error: PDServeError) -> grpc.StatusCode:
    return _GRPC_STATUS[error.code]


def grpc_usage(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        prefill_mode=usage.prefill_mode,
        phases=pb.PhaseTimes(**{k: float(v) for k, v in usage.phases.items()}),
        draft_tokens=usage.draft_tokens,
        accepted_draft_tokens=usage.accepted_draft_tokens,
    )


def grpc_chunk(chunk: StreamChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=_FINISH.get(chunk.finish_reason, pb.FINISH_REASON_STOP),
        index=chunk.index,
    )
    if chunk.logprobs is not None:
        tops = chunk.top_logprobs or [[] for _ in chunk.logprobs]
        for lp, top in zip(chunk.logprobs, tops, strict=False):
            msg.logprobs.append(
                pb.Logprobs(
                    logprob=lp, top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in top]
                )
            )
    if chunk.usage is not None:
        msg.usage.CopyFrom(grpc_usage(chunk.usage))
    return msg


# -- OpenAI: errors and usage -----------------------------------------------------------------


def openai_error(error: PDServeError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) in OpenAI's error shape; ``param`` is the field the message names."""
    # A message may quote client input: never let a lone surrogate break the rendering.
    message = error.message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = None
    if error.code == ErrorCode.INVALID_ARGUMENT and ":" in message:
        head = message.split(":", 1)[0]
        if head and " " not in head:
            param = head
    code = error.code.value.lower()
    if error.code == ErrorCode.NOT_FOUND and message.startswith("model"):
        code, param = "model_not_found", "model"
    if error.code == ErrorCode.UNAUTHENTICATED:
        code = "invalid_api_key"
    body = {
        "error": {
            "message": message,
            "type": error.code.openai_type,
            "param": param,
            "code": code,
        }
    }
    if error.request_id:
        body["error"]["request_id"] = error.request_id
    return error.code.http_status, body


def error_response(error: PDServeError) -> JSONResponse:
    """An error in OpenAI's shape, with ``Retry-After`` (whole seconds, at least 1) when the
    error carries a retry delay (an overloaded cluster's 429)."""
    status, payload = openai_error(error)
    headers = {}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse(payload, status_code=status, headers=headers)


def openai_usage(usage: Usage | None) -> dict[str, Any]:
    u = usage or Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "pdserve": {
            "prefill_mode": u.prefill_mode,
            "phases": dict(u.phases),
            "speculative": {
                "draft_tokens": u.draft_tokens,
                "accepted_draft_tokens": u.accepted_draft_tokens,
            },
        },
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- OpenAI: logprobs ---------------------------------------------------------------------------


class _TokenText:
    """Token strings for logprobs (a token's own text, as the OpenAI API reports it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))


def _completion_logprobs(
    chunk: StreamChunk, text_of: _TokenText, offset: int, prompt: list[int] | None = None
) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs; with ``echo`` (``prompt``: its token ids) the chunk that
    starts the choice leads with the prompt's tokens: null for the first, offsets from 0."""
    if chunk.logprobs is None:
        return None
    tokens = [text_of(t) for t in chunk.token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = chunk.top_logprobs or [[] for _ in chunk.logprobs]
    out: dict[str, Any] = {
        "tokens": tokens,
        "token_logprobs": list(chunk.logprobs),
        "top_logprobs": [{text_of(t): v for t, v in top} for top in tops],
        "text_offset": offsets,
    }
    if prompt is None or chunk.prompt_logprobs is None:
        return out
    entries = chunk.prompt_logprobs
    ptokens = [text_of(t) for t in prompt]
    poffsets = [0, *itertools.accumulate(len(t) for t in ptokens)][:-1]
    out["tokens"] = ptokens + out["tokens"]
    out["token_logprobs"] = [e[0] if e else None for e in entries] + out["token_logprobs"]
    ptops = [{text_of(t): v for t, v in e[1]} if e else None for e in entries]
    out["top_logprobs"] = ptops + out["top_logprobs"]
    out["text_offset"] = poffsets + offsets
    return out


def _echoed(parsed: ParsedRequest) -> list[int] | None:
    """The prompt's ids when its logprobs are echoed (completions, echo with logprobs)."""
    return parsed.prompt_token_ids if parsed.params.prompt_logprobs is not None else None


def _chat_logprobs(chunk: StreamChunk, text_of: _TokenText) -> dict[str, Any] | None:
    if chunk.logprobs is None:
        return None
    tops = chunk.top_logprobs or [[] for _ in chunk.logprobs]

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
            for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops, strict=False)
        ]
    }


def _merge(chunks: Iterable[StreamChunk]) -> tuple[StreamChunk, Usage | None]:
    """All chunks of one finished sample as one (for the non-streaming responses)."""
    rid, ids, texts = "", [], []
    lps: list[float] | None = None
    tops: list[list[tuple[int, float]]] | None = None
    finish, usage, index = None, None, 0
    prompt_logprobs = None
    for c in chunks:
        rid, index = c.request_id, c.index
        prompt_logprobs = prompt_logprobs or c.prompt_logprobs
        ids.extend(c.token_ids)
        texts.append(c.text)
        if c.logprobs is not None:
            lps = (lps or []) + list(c.logprobs)
            tops = (tops or []) + list(c.top_logprobs or [[] for _ in c.logprobs])
        finish = c.finish_reason or finish
        usage = c.usage or usage
    merged = StreamChunk(rid, ids, "".join(texts), lps, tops, finish, usage, index, prompt_logprobs)
    return merged, usage


def _choices(
    parsed: ParsedRequest, chunks: list[StreamChunk]
) -> tuple[list[StreamChunk], Usage | None]:
    """Each sample's chunks merged, in index order; with ``best_of`` > n, the n samples of
    highest total logprob (re-indexed from 0). The usage counts every sample generated."""
    by_index: dict[int, list[StreamChunk]] = {i: [] for i in range(parsed.best_of)}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    merged = [_merge(by_index[i])[0] for i in sorted(by_index)]
    usage = next((c.usage for c in reversed(chunks) if c.usage is not None), None)
    if parsed.best_of > parsed.n:
        merged.sort(key=lambda c: -sum(c.logprobs or ()))
        merged = merged[: parsed.n]
    merged = [dataclasses.replace(c, index=i) for i, c in enumerate(merged)]
    if not parsed.client_logprobs:
        merged = [dataclasses.replace(c, logprobs=None, top_logprobs=None) for c in merged]
    return merged, usage


# -- OpenAI: non-streaming ----------------------------------------------------------------------


def aggregate_completion(
    parsed: ParsedRequest, model: str, chunks: list[StreamChunk], tokenizer: Any
) -> dict[str, Any]:
    merged, usage = _choices(parsed, chunks)
    echo = parsed.echo or ""
    return {
        "id": parsed.request_id,
        "object": "text_completion",
        "created": parsed.created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": echo + c.text,
                "logprobs": _completion_logprobs(
                    c, _TokenText(tokenizer), len(echo), _echoed(parsed)
                ),
                "finish_reason": c.finish_reason or "stop",
            }
            for c in merged
        ],
        "usage": openai_usage(usage),
    }


def aggregate_chat(
    parsed: ParsedRequest, model: str, chunks: list[StreamChunk], tokenizer: Any
) -> dict[str, Any]:
    merged, usage = _choices(parsed, chunks)
    return {
        "id": parsed.request_id,
        "object": "chat.completion",
        "created": parsed.created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c, _TokenText(tokenizer)),
                "finish_reason": c.finish_reason or "stop",
            }
            for c in merged
        ],
        "usage": openai_usage(usage),
    }


# -- OpenAI: streaming (SSE) --------------------------------------------------------------------


class _Stream:
    object_name = ""

    def __init__(self, parsed: ParsedRequest, model: str, tokenizer: Any) -> None:
        self.parsed = parsed
        self.model = model
        self.text_of = _TokenText(tokenizer)
        self.usage: Usage | None = None
        self.completion_tokens = 0  # so far, every sample (continuous usage)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.parsed.request_id,
            "object": self.object_name,
            "created": self.parsed.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, chunk: StreamChunk) -> dict[str, Any] | None:
        raise NotImplementedError

    def _with_usage(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A chunk's ``usage``: the count so far (continuous_usage_stats, vLLM's extension), or
        null on every chunk but the last (include_usage, as OpenAI sends it)."""
        if self.parsed.continuous_usage:
            if self.usage is not None:
                payload["usage"] = openai_usage(self.usage)
            else:
                prompt = len(self.parsed.prompt_token_ids)
                payload["usage"] = {
                    "prompt_tokens": prompt,
                    "completion_tokens": self.completion_tokens,
                    "total_tokens": prompt + self.completion_tokens,
                }
        elif self.parsed.include_usage:
            payload["usage"] = None
        return payload

    def events(self, chunk: StreamChunk) -> Iterator[str]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        self.completion_tokens += len(chunk.token_ids)
        choice = self._choice(chunk)
        if choice is not None:
            yield _sse(self._with_usage(self._envelope([choice])))

    def finish(self) -> Iterator[str]:
        if self.parsed.include_usage:
            payload = self._envelope([])
            payload["usage"] = openai_usage(self.usage)
            yield _sse(payload)
        yield "data: [DONE]\n\n"


class CompletionStream(_Stream):
    object_name = "text_completion"

    def __init__(self, parsed: ParsedRequest, model: str, tokenizer: Any) -> None:
        super().__init__(parsed, model, tokenizer)
        self.offsets: dict[int, int] = {}  # per sample: characters sent so far

    def _choice(self, chunk: StreamChunk) -> dict[str, Any] | None:
        if not chunk.token_ids and not chunk.text and chunk.finish_reason is None:
            return None
        offset = self.offsets.get(chunk.index)
        text = chunk.text if offset is not None else (self.parsed.echo or "") + chunk.text
        offset = offset if offset is not None else len(text) - len(chunk.text)
        logprobs = _completion_logprobs(chunk, self.text_of, offset, _echoed(self.parsed))
        self.offsets[chunk.index] = offset + len(chunk.text)
        return {
            "index": chunk.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": chunk.finish_reason,
        }


class ChatStream(_Stream):
    object_name = "chat.completion.chunk"

    def __init__(self, parsed: ParsedRequest, model: str, tokenizer: Any) -> None:
        super().__init__(parsed, model, tokenizer)
        self.started = False

    def events(self, chunk: StreamChunk) -> Iterator[str]:
        if not self.started:
            # OpenAI's first chunk of each choice announces the role with empty content.
            self.started = True
            for index in range(self.parsed.n):
                first = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse(self._with_usage(self._envelope([first])))
        yield from super().events(chunk)

    def _choice(self, chunk: StreamChunk) -> dict[str, Any] | None:
        if not chunk.token_ids and not chunk.text and chunk.finish_reason is None:
            return None
        delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
        return {
            "index": chunk.index,
            "delta": delta,
            "logprobs": _chat_logprobs(chunk, self.text_of),
            "finish_reason": chunk.finish_reason,
        }


def error_event(error: PDServeError) -> str:
    """A failure after the SSE headers went out: a final error event, never a silent cut."""
    _status, payload = openai_error(error)
    return _sse(payload)
