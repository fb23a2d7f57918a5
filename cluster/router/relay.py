"""Router -> decode pool: one request's stream, with retries only before the first token, and
live migration when its decode replica is drained.

A decode replica that fails (or cannot be reached within the assignment timeout) before anything
reached the client is retried on another replica, the failed one excluded
(``serving.calls.retrying_stream``). Once a token has been streamed the request is never
retried: the stream ends with ABORTED, never silently truncated.

A drained decode replica says ``Migrating(resume)`` in the stream (``decode_worker.migration``):
the relay calls the decode pool with ``resume`` (that replica excluded) and keeps whichever of
the two streams goes on first: the new replica's once it pulled the KV, or the old one's when
no replica took the request (its lease then ends unpulled and it decodes on). Either way the
client's stream continues with the next token, once: both would produce the same tokens
(sampling is keyed by seed and output index), and the loser's call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import GenerateCall, Migrating, StreamChunk
from cluster.config import RouterConfig
from cluster.serving.calls import retrying_stream, streaming_handle

logger = logging.getLogger(__name__)
Items = AsyncGenerator[Any, None]
_END = object()  # a stream's end, as a task's result


def _streams_output(chunk: StreamChunk) -> bool:
    return bool(chunk.token_ids or chunk.text)


async def _next(items: Items) -> Any:
    try:
        return await items.__anext__()
    except StopAsyncIteration:
        return _END


async def _close(items: Items, task: asyncio.Future[Any] | None) -> None:
    """Stop reading ``items`` (its call is cancelled on its replica)."""
    if task is not None and not task.done():
        task.cancel()
    if task is not None:
        with contextlib.suppress(BaseException):
            await task
    with contextlib.suppress(Exception):
        await items.aclose()


class DecodeRelay:
    def __init__(self, decode_handle: Any, config: RouterConfig) -> None:
        self.handle = streaming_handle(decode_handle, config.pool_call_transport)
        self.config = config
        self.num_retries = 0
        self.migrations = {"started": 0, "moved": 0, "stayed": 0, "failed": 0}

    def _count_retry(self) -> None:
        self.num_retries += 1

    def _open(self, call: GenerateCall, retries: int) -> Items:
        return retrying_stream(
            lambda excluded: self.handle.generate.remote(
                dataclasses.replace(
                    call, exclude_replicas=tuple(dict.fromkeys(call.exclude_replicas + excluded))
                )
            ),
            request_id=call.request_id,
            retries=retries,
            assignment_timeout_s=self.config.assignment_timeout_s,
            stall_timeout_s=self.config.stall_timeout_s,
            deadline=call.deadline,
            is_progress=_streams_output,
            on_retry=self._count_retry,
        )

    async def stream(self, call: GenerateCall) -> AsyncIterator[StreamChunk]:
        streamed = False
        items = self._open(call, self.config.retries)
        try:
            pending: Any = _END
            while True:
                item = pending if pending is not _END else await _next(items)
                pending = _END
                if item is _END:
                    return
                if isinstance(item, Migrating):
                    items, pending = await self._hand_over(call, items, item)
                    continue
                streamed = streamed or _streams_output(item)
                yield item
        except PDServeError as e:
            if streamed and e.code == ErrorCode.UNAVAILABLE:
                raise PDServeError(
                    ErrorCode.ABORTED,
                    "the decode replica failed after the first token; retry the request",
                    call.request_id,
                ) from None
            raise
        finally:
            await items.aclose()  # the client went away: cancel in every pool

    async def _hand_over(
        self, call: GenerateCall, source: Items, migrating: Migrating
    ) -> tuple[Items, Any]:
        """The source replica is drained: call the pool with ``resume``; returns the stream
        that goes on and its next item (the losing call is cancelled)."""
        self.migrations["started"] += 1
        resume = migrating.resume
        target_call = dataclasses.replace(
            call, resume=resume, exclude_replicas=(resume.source_replica,)
        )
        target = self._open(target_call, 0)
        s_task: asyncio.Future[Any] | None = asyncio.ensure_future(_next(source))
        t_task: asyncio.Future[Any] | None = asyncio.ensure_future(_next(target))
        try:
            while True:
                waits = [t for t in (s_task, t_task) if t is not None]
                if not waits:
                    self.migrations["failed"] += 1
                    raise PDServeError(
                        ErrorCode.ABORTED,
                        "the request's migration to another decode replica failed; retry it",
                        call.request_id,
                    )
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if t_task in done:
                    item, t_task = _outcome(t_task, call, "target"), None
                    if item is not _END:  # it pulled the KV and decodes: it goes on
                        await _close(source, s_task)
                        s_task = None
                        self.migrations["moved"] += 1
                        return target, item
                if s_task in done:
                    item, s_task = _outcome(s_task, call, "source"), None
                    if item is not _END:  # not taken: it decodes on where it was
                        await _close(target, t_task)
                        t_task = None
                        self.migrations["stayed"] += 1
                        return source, item
        finally:
            if s_task is not None:
                await _close(source, s_task)
            if t_task is not None:
                await _close(target, t_task)


def _outcome(task: asyncio.Future[Any], call: GenerateCall, side: str) -> Any:
    """A stream's next item, or ``_END`` when it ended or failed (logged: the other side may
    still carry the request)."""
    try:
        return task.result()
    except Exception as e:
        logger.info("request %s: migration %s stream ended: %r", call.request_id, side, e)
        return _END
