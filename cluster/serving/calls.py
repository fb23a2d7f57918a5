"""Calling a pool through a Ray Serve handle: one streaming call with retries, error mapping.

Every pool stream starts with ``Accepted(replica_id)``, so a caller knows within
``assignment_timeout_s`` whether any replica took the call (an empty or saturated pool would
otherwise wait forever), and which replica to exclude if it fails before making progress.
``retrying_stream`` is the one implementation: the router's relay to the decode pool and a
decode replica's call to the prefill pool both use it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from cluster.common.errors import ErrorCode, PDServeError, internal_error
from cluster.common.protocol import Accepted

T = TypeVar("T")
logger = logging.getLogger(__name__)


async def _bounded(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw`` for at most ``timeout_s``, then ``TimeoutError`` (``aw`` is cancelled).
    ``asyncio.timeout`` in this task rather than ``wait_for``, which makes a task per await:
    this runs once per streamed chunk at the router and at each decode replica."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def within_deadline(aw: Awaitable[T], deadline: float | None, request_id: str) -> T:
    """Await ``aw`` until the wall-clock ``deadline`` (None: no bound), then DEADLINE_EXCEEDED."""
    if deadline is None:
        return await aw
    try:
        return await _bounded(aw, max(0.0, deadline - time.time()))
    except asyncio.TimeoutError:
        raise PDServeError(
            ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed", request_id
        ) from None


@dataclass(frozen=True, slots=True)
class Keepalive:
    """A pool stream's sign of life while it has nothing to say (``retrying_stream`` drops it:
    never shown to a caller)."""


KEEPALIVE = Keepalive()


class PoolResponse(Protocol):
    """What a streaming Serve handle call returns (``DeploymentResponseGenerator``)."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def __anext__(self) -> Awaitable[Any]: ...

    def cancel(self) -> None: ...


def streaming_handle(handle: Any, transport: str) -> Any:
    """``handle`` set up for pool streams over ``transport`` (``router.pool_call_transport``):
    "grpc" sends each call and chunk over Serve's gRPC channel between replicas, "object_ref"
    through Ray actor calls (an object reference per chunk)."""
    return handle.options(stream=True, _by_reference=transport != "grpc")


def _grpc_status(e: BaseException) -> str | None:
    """The status name of a gRPC error from Serve's replica channel (None: not one)."""
    import grpc

    return e.code().name if isinstance(e, grpc.aio.AioRpcError) else None


def as_pdserve_error(e: BaseException, request_id: str = "") -> PDServeError:
    """Map whatever a Serve call raised to the status the API edge returns."""
    from ray import exceptions as rex
    from ray.serve import exceptions as sex

    cause = getattr(e, "cause", None)
    if isinstance(e, PDServeError):
        return e
    if isinstance(cause, PDServeError):
        return cause
    if isinstance(e, sex.BackPressureError):
        # Serve's own queue bound, behind the router's admission: no queue figures here, so
        # the shortest delay a client is worth being told (one second).
        return PDServeError(
            ErrorCode.RESOURCE_EXHAUSTED,
            "the cluster is at capacity; retry",
            request_id,
            retry_after_s=1.0,
        )
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return PDServeError(
            ErrorCode.UNAVAILABLE, "no replica accepted the request in time", request_id
        )
    if isinstance(
        e,
        rex.RayActorError
        | sex.DeploymentUnavailableError
        | sex.ReplicaUnavailableError
        | rex.ActorUnavailableError,
    ):
        return PDServeError(ErrorCode.UNAVAILABLE, "a replica became unavailable", request_id)
    if isinstance(e, sex.RequestCancelledError | asyncio.CancelledError):
        return PDServeError(ErrorCode.CANCELLED, "the request was cancelled", request_id)
    status = _grpc_status(e)
    # Serve maps UNAVAILABLE itself; a replica going away mid-stream can also end its calls
    # CANCELLED from its side (a local cancel is asyncio.CancelledError, handled above).
    if status in ("UNAVAILABLE", "CANCELLED"):
        return PDServeError(ErrorCode.UNAVAILABLE, "a replica became unavailable", request_id)
    logger.warning("request %s: a pool call failed: %r", request_id, e)  # the details stay here
    return internal_error(request_id)


def is_retryable(err: PDServeError) -> bool:
    return err.code == ErrorCode.UNAVAILABLE


async def retrying_stream(
    call: Callable[[tuple[str, ...]], PoolResponse],
    *,
    request_id: str,
    retries: int,
    assignment_timeout_s: float,
    deadline: float | None = None,
    stall_timeout_s: float | None = None,
    is_progress: Callable[[Any], bool] = lambda item: True,
    on_retry: Callable[[], None] | None = None,
) -> AsyncGenerator[Any, None]:
    """The items of one pool call, retried on another replica until it makes progress.

    ``call(excluded)`` starts the call on a replica not in ``excluded``. Each attempt must be
    accepted within ``assignment_timeout_s``. A retryable failure (UNAVAILABLE: a dead or
    unreachable replica) before any item ``is_progress`` accepts re-calls with that replica
    excluded, at most ``retries`` times. A call no replica accepted within the window is not
    re-called: the pool had the whole window to take it (an empty pool answers UNAVAILABLE
    after one window, not ``retries + 1`` of them). Any other failure, and any failure
    after progress, is raised as a ``PDServeError`` (the caller decides what a failure after
    progress means). Every await is bounded by ``deadline`` (wall clock): DEADLINE_EXCEEDED.
    Once accepted, a replica silent for ``stall_timeout_s`` (no item, not even a
    ``Keepalive``, which is never yielded) has failed: UNAVAILABLE (a hung or stopped process).
    Closing the stream early, or cancelling it, cancels the call on its replica.
    """
    excluded: list[str] = []
    progressed = False
    for attempt in range(retries + 1):
        response = call(tuple(excluded))
        replica_id = ""
        try:
            replica_id = await _accepted_by(response, assignment_timeout_s, deadline, request_id)
            while True:
                try:
                    item = await _next(response, deadline, stall_timeout_s, request_id)
                except StopAsyncIteration:
                    return
                if isinstance(item, Keepalive):
                    continue
                progressed = progressed or is_progress(item)
                yield item
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the finally cancels the call on the replica
        except (Exception, StopAsyncIteration) as e:  # StopAsyncIteration: ended before Accepted
            err = as_pdserve_error(e, request_id)
            # no replica took the call within the window (replica_id is set once one did)
            waited_out = not replica_id and isinstance(e, asyncio.TimeoutError | TimeoutError)
            if progressed or waited_out or not is_retryable(err) or attempt == retries:
                raise err from None
            if replica_id:
                excluded.append(replica_id)
            if on_retry is not None:
                on_retry()
        finally:
            _cancel(response)
    raise PDServeError(ErrorCode.UNAVAILABLE, "no replica answered", request_id)


def _cancel(response: PoolResponse) -> None:
    """Cancel the call on its replica, best effort. A call Serve never assigned (refused by its
    backpressure, say) has nothing to cancel, and Ray's ``cancel`` re-raises that refusal: it
    must not replace the error already on its way to the client (RESOURCE_EXHAUSTED -> INTERNAL)."""
    try:
        response.cancel()
    except Exception as e:  # the call's own outcome is what the caller gets
        logger.debug("cancelling a pool call: %s", type(e).__name__)


async def _next(
    response: PoolResponse, deadline: float | None, stall_s: float | None, request_id: str
) -> Any:
    if stall_s is None or (deadline is not None and deadline - time.time() <= stall_s):
        return await within_deadline(response.__anext__(), deadline, request_id)
    try:
        return await _bounded(response.__anext__(), stall_s)
    except asyncio.TimeoutError:
        raise PDServeError(
            ErrorCode.UNAVAILABLE,
            f"the replica stopped responding ({stall_s:g} s without a sign of life)",
            request_id,
        ) from None


async def _accepted_by(
    response: PoolResponse, timeout_s: float, deadline: float | None, request_id: str
) -> str:
    """The id of the replica that took the call: its first item, ``Accepted``, within the
    assignment timeout, or the deadline if that is sooner (each with its own status:
    UNAVAILABLE is retried, DEADLINE_EXCEEDED is not)."""
    if deadline is not None and deadline - time.time() <= timeout_s:
        accepted = await within_deadline(response.__anext__(), deadline, request_id)
    else:
        accepted = await _bounded(response.__anext__(), timeout_s)
    if not isinstance(accepted, Accepted):
        raise PDServeError(ErrorCode.INTERNAL, "a pool stream did not start with Accepted")
    return accepted.replica_id
