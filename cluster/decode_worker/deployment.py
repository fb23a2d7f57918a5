"""The decode pool as a Ray Serve deployment: ``DecodeServer``, one ``DecodeWorker`` a replica.

It reaches the prefill pool through a Serve handle (``ServePrefillClient``): before the first
reply, a failed or unreachable prefill replica is retried on another (the failed one excluded,
``serving.calls.retrying_stream``), and after the retries the decode replica prefills locally.
Its ``generate`` stream starts with ``Accepted`` (so the router can bound assignment and exclude
it on a retry). Health, stats, metrics, the routing and autoscaling reports and the test-mode
fault hooks come from ``serving.replica.PoolReplica``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cluster.common.protocol import (
    Accepted,
    GenerateCall,
    Migrating,
    PrefillCall,
    PrefillProgress,
    PrefillReply,
    StreamChunk,
)
from cluster.config import ClusterConfig, config_from_dict
from cluster.decode_worker.worker import DecodeWorker
from cluster.serving.calls import Keepalive, retrying_stream, streaming_handle
from cluster.serving.replica import (
    PoolReplica,
    bind_pool_replica,
    current_replica_id,
    serve_stopping_probe,
)
from cluster.serving.routers import recent_ranking_ms
from cluster.serving.signals import decode_autoscaling_stats

PREFILL_READY_TIMEOUT_S = 1.5  # within the router's readiness probe timeout (>= 2 s)
STOPPING_POLL_S = 0.2  # how often a decode replica checks whether Serve began stopping it
logger = logging.getLogger(__name__)


class ServePrefillClient:
    """The prefill pool through its Serve handle (the pool's request router picks a replica)."""

    def __init__(self, handle: Any, config: ClusterConfig) -> None:
        self.plain_handle = handle
        self.handle = streaming_handle(handle, config.router.pool_call_transport)
        self.retries = config.router.retries
        self.assignment_timeout_s = config.router.assignment_timeout_s
        self.stall_timeout_s = config.router.stall_timeout_s
        self.readiness_window_s = 2 * config.router.readiness_period_s
        self.num_retries = 0
        self.last_reply = float("-inf")  # monotonic: the last prefill reply

    def _count_retry(self) -> None:
        self.num_retries += 1

    async def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillProgress | PrefillReply]:
        replies = retrying_stream(
            lambda excluded: self.handle.prefill.remote(
                dataclasses.replace(call, exclude_replicas=excluded)
            ),
            request_id=call.request_id,
            retries=self.retries,
            assignment_timeout_s=self.assignment_timeout_s,
            stall_timeout_s=self.stall_timeout_s,
            on_retry=self._count_retry,
        )
        try:
            async for reply in replies:
                self.last_reply = time.monotonic()
                yield reply
        finally:
            await replies.aclose()  # closing this stream cancels the call on its replica

    async def ready(self, timeout_s: float) -> bool:
        """The prefill pool can take a request: it just replied to one, or a replica says so."""
        if time.monotonic() - self.last_reply < self.readiness_window_s:
            return True
        try:
            return bool(await asyncio.wait_for(self.plain_handle.ready.remote(), timeout_s))
        except Exception:  # timed out, no replica, a dead one
            return False


@serve.deployment(name="DecodeServer")
class DecodeServer(PoolReplica):
    role = "decode"
    worker: DecodeWorker

    def __init__(self, config: dict[str, Any], prefill_handle: Any = None) -> None:
        cfg = config_from_dict(config)
        self.cores = bind_pool_replica(cfg, self.role)  # first: the threads below inherit it
        self.prefill_client = (
            ServePrefillClient(prefill_handle, cfg) if prefill_handle is not None else None
        )
        replica_id = current_replica_id()
        worker = DecodeWorker(cfg, self.prefill_client, instance_id=replica_id).start()
        super().__init__(cfg, replica_id, worker)
        self._stopping = serve_stopping_probe() if cfg.decode.migrate_on_drain else None
        self._watch_task: asyncio.Task[None] | None = None

    def _started(self) -> None:
        super()._started()
        if self._watch_task is None and self._stopping is not None:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_stopping())

    async def _watch_stopping(self) -> None:
        """Serve began stopping this replica (scale-down, upgrade): drain it at once, moving
        its decoding requests to the other replicas, rather than wait for them to finish."""
        assert self._stopping is not None
        while not self._stopping():
            await asyncio.sleep(STOPPING_POLL_S)
        logger.info("decode replica %s is stopping: draining it", self.replica_id)
        try:
            await self.worker.drain()
        except Exception:  # its streams then finish here, within the graceful timeout
            logger.exception("draining decode replica %s failed", self.replica_id)

    async def drain(self, replica_id: str | None = None) -> dict[str, Any]:
        """Operators (``pdserve drain``): stop taking calls and move this replica's decoding
        requests to the others (live migration); the replica stays up, idle, until removed.
        ``replica_id``: only that replica drains (the pool's router picks who answers a call,
        so a caller asks until the named one did); any other just reports itself."""
        self._started()
        if replica_id is not None and replica_id != self.replica_id:
            return {"replica_id": self.replica_id, "drained": False}
        return {"replica_id": self.replica_id, "drained": True, **await self.worker.drain()}

    def replica_info(self) -> dict[str, Any]:
        """Who this replica is and what it runs (``pdserve drain`` lists the pool with it)."""
        eng = self.worker.engine.stats()
        return {
            "replica_id": self.replica_id,
            "running": eng.get("num_running", 0),
            "draining": self.worker.draining,
        }

    async def generate(
        self, call: GenerateCall
    ) -> AsyncIterator[Accepted | StreamChunk | Migrating | Keepalive]:
        self._started()
        yield Accepted(self.replica_id)
        async with contextlib.aclosing(self.with_keepalives(self.worker.generate(call))) as items:
            async for chunk in items:
                yield chunk

    async def dependencies_ready(self) -> bool:
        if self.prefill_client is None:  # a colocated cluster: no prefill pool to ask
            return True
        return await self.prefill_client.ready(PREFILL_READY_TIMEOUT_S)

    def autoscaling_signals(self, stats: dict[str, Any]) -> dict[str, float]:
        return decode_autoscaling_stats(stats, self.worker.config.scheduler.max_num_seqs)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["prefill_retries"] = self.prefill_client.num_retries if self.prefill_client else 0
        s["ranking_ms"] = recent_ranking_ms()  # the prefill pool's routing, in this replica
        return s
