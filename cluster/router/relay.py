"""Router -> decode pool: one request's stream, with retries only before the first token.

A decode replica that fails (or cannot be reached within the assignment timeout) before anything
reached the client is retried on another replica, the failed one excluded
(``serving.calls.retrying_stream``). Once a token has been streamed the request is never
retried: the stream ends with ABORTED, never silently truncated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import GenerateCall, StreamChunk
from cluster.config import RouterConfig
from cluster.serving.calls import retrying_stream, streaming_handle


def _streams_output(chunk: StreamChunk) -> bool:
    return bool(chunk.token_ids or chunk.text)


class DecodeRelay:
    def __init__(self, decode_handle: Any, config: RouterConfig) -> None:
        self.handle = streaming_handle(decode_handle, config.pool_call_transport)
        self.config = config
        self.num_retries = 0

    def _count_retry(self) -> None:
        self.num_retries += 1

    async def stream(self, call: GenerateCall) -> AsyncIterator[StreamChunk]:
        streamed = False
        chunks = retrying_stream(
            lambda excluded: self.handle.generate.remote(
                dataclasses.replace(call, exclude_replicas=excluded)
            ),
            request_id=call.request_id,
            retries=self.config.retries,
            assignment_timeout_s=self.config.assignment_timeout_s,
            stall_timeout_s=self.config.stall_timeout_s,
            deadline=call.deadline,
            is_progress=_streams_output,
            on_retry=self._count_retry,
        )
        try:
            async for chunk in chunks:
                streamed = streamed or _streams_output(chunk)
                yield chunk
        except PDServeError as e:
            if streamed and e.code == ErrorCode.UNAVAILABLE:
                raise PDServeError(
                    ErrorCode.ABORTED,
                    "the decode replica failed after the first token; retry the request",
                    call.request_id,
                ) from None
            raise
        finally:
            await chunks.aclose()  # the client went away: cancel in every pool
