"""Calling a pool through a Ray Serve handle: streams, first-reply timeouts, error mapping.

Every pool stream starts with ``Accepted(replica_id)``, so a caller knows within
``assignment_timeout_s`` whether any replica took the call (an empty or saturated pool would
otherwise wait forever), and which replica to exclude if it fails before the first token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import AsyncIterator
from typing import Any

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import Accepted


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
        return PDServeError(
            ErrorCode.RESOURCE_EXHAUSTED, "the cluster is at capacity; retry", request_id
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
    return PDServeError(ErrorCode.INTERNAL, f"internal error (request {request_id})", request_id)


def is_retryable(err: PDServeError) -> bool:
    return err.code == ErrorCode.UNAVAILABLE


class PoolStream:
    """One call's stream: ``accept()`` waits for ``Accepted``, then iterate the items."""

    def __init__(self, response: Any) -> None:
        self.response = response  # a DeploymentResponseGenerator
        self.replica_id = ""

    async def accept(self, timeout_s: float) -> str:
        item = await asyncio.wait_for(self.response.__anext__(), timeout_s)
        if not isinstance(item, Accepted):
            raise PDServeError(ErrorCode.INTERNAL, "a pool stream did not start with Accepted")
        self.replica_id = item.replica_id
        return item.replica_id

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.response.__aiter__()

    def cancel(self) -> None:
        self.response.cancel()


def replica_stats(server: Any, replica_id: str) -> dict[str, Any]:
    """A pool replica's ``stats()``: its server's engine stats plus what tests and operators ask
    every replica (id, pid, paused fault points, KV blocks in use)."""
    s: dict[str, Any] = server.stats()
    s["replica_id"] = replica_id
    s["paused_faults"] = server.faults.paused()
    s["pid"] = os.getpid()
    try:
        s["kv_used_blocks"] = server.loop.call(lambda e: e.block_manager.num_used_blocks).result(
            1.0
        )
    except concurrent.futures.TimeoutError:
        s["kv_used_blocks"] = None  # the engine is busy or paused: unknown right now
    return s
