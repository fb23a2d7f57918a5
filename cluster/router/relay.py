"""Router -> decode pool: one request's stream, with retries only before the first token.

A decode replica that fails (or cannot be reached within the assignment timeout) before anything
reached the client is retried on another replica, the failed one excluded. Once a token has been
streamed the request is never retried: the stream ends with ABORTED, never silently truncated.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import GenerateCall, StreamChunk
from cluster.common.serve_calls import PoolStream, as_pdserve_error, is_retryable
from cluster.config import RouterConfig


class DecodeRelay:
    def __init__(self, decode_handle: Any, config: RouterConfig) -> None:
        self.handle = decode_handle.options(stream=True)
        self.config = config
        self.num_retries = 0

    async def stream(self, call: GenerateCall) -> AsyncIterator[StreamChunk]:
        excluded: list[str] = []
        streamed = False
        for attempt in range(self.config.retries + 1):
            pool = PoolStream(
                self.handle.generate.remote(
                    dataclasses.replace(call, exclude_replicas=tuple(excluded))
                )
            )
            try:
                await self._within_deadline(call, pool.accept(self.config.assignment_timeout_s))
                it = pool.__aiter__()
                while True:
                    try:
                        chunk = await self._within_deadline(call, it.__anext__())
                    except StopAsyncIteration:
                        return
                    streamed = streamed or bool(chunk.token_ids or chunk.text)
                    yield chunk
            except GeneratorExit:
                pool.cancel()  # the client went away: cancel in every pool
                raise
            except asyncio.CancelledError:
                pool.cancel()
                raise
            except Exception as e:
                pool.cancel()
                err = as_pdserve_error(e, call.request_id)
                if streamed:
                    if err.code == ErrorCode.UNAVAILABLE:
                        raise PDServeError(
                            ErrorCode.ABORTED,
                            "the decode replica failed after the first token; retry the request",
                            call.request_id,
                        ) from None
                    raise err from None
                if not is_retryable(err) or attempt == self.config.retries:
                    raise err from None
                if pool.replica_id:
                    excluded.append(pool.replica_id)
                self.num_retries += 1

    @staticmethod
    async def _within_deadline(call: GenerateCall, aw: Any) -> Any:
        remaining = call.remaining_s()
        if remaining is None:
            return await aw
        try:
            return await asyncio.wait_for(aw, max(0.0, remaining))
        except asyncio.TimeoutError:
            raise PDServeError(
                ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed", call.request_id
            ) from None
