"""The decode pool as a Ray Serve deployment: a ``DecodeServer`` per replica.

It reaches the prefill pool through a Serve handle (``ServePrefillClient``): before the first
token, a failed or unreachable prefill replica is retried on another (the failed one excluded),
and after the retries the decode replica prefills locally. Its ``generate`` stream starts with
``Accepted`` (so the router can bound assignment and exclude it on a retry).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cluster.common.autoscaling_stats import decode_autoscaling_stats
from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.metrics import PoolMetrics
from cluster.common.protocol import Accepted, GenerateCall, PrefillCall, PrefillReply, StreamChunk
from cluster.common.routing_policy import replica_routing_stats
from cluster.common.serve_calls import PoolStream, as_pdserve_error, is_retryable, replica_stats
from cluster.config import ClusterConfig, config_from_dict
from cluster.decode_worker.server import DecodeServer

logger = logging.getLogger(__name__)
METRICS_PERIOD_S = 1.0


class ServePrefillClient:
    def __init__(self, handle: Any, config: ClusterConfig) -> None:
        self.handle = handle.options(stream=True)
        self.retries = config.router.retries
        self.assignment_timeout_s = config.router.assignment_timeout_s
        self.num_retries = 0

    async def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        excluded: list[str] = []
        last: PDServeError | None = None
        for _attempt in range(self.retries + 1):
            attempt_call = dataclasses.replace(call, exclude_replicas=tuple(excluded))
            stream = PoolStream(self.handle.prefill.remote(attempt_call))
            try:
                await stream.accept(self.assignment_timeout_s)
                first = await stream.__aiter__().__anext__()
            except (Exception, StopAsyncIteration) as e:
                stream.cancel()
                err = as_pdserve_error(e, call.request_id)
                if isinstance(e, StopAsyncIteration) or not is_retryable(err):
                    raise err from None
                last = err
                if stream.replica_id:
                    excluded.append(stream.replica_id)
                self.num_retries += 1
                continue
            try:
                yield first
                async for item in stream:
                    yield item
            finally:
                stream.cancel()  # closing early (pulled, cancelled): end the call on the replica
            return
        raise last or PDServeError(ErrorCode.UNAVAILABLE, "no prefill replica answered")


@serve.deployment(name="DecodeServer")
class DecodeDeployment:
    def __init__(self, config: dict[str, Any], prefill_handle: Any = None) -> None:
        self.config = config_from_dict(config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.prefill_client = (
            ServePrefillClient(prefill_handle, self.config) if prefill_handle is not None else None
        )
        self.server = DecodeServer(
            self.config, self.prefill_client, instance_id=self.replica_id
        ).start()
        self.metrics = PoolMetrics("decode")
        self._metrics_task: asyncio.Task[None] | None = None

    async def generate(self, call: GenerateCall) -> AsyncIterator[Accepted | StreamChunk]:
        if self._metrics_task is None:
            self._metrics_task = asyncio.get_running_loop().create_task(self._publish_metrics())
        yield Accepted(self.replica_id)
        async for chunk in self.server.generate(call):
            yield chunk

    async def _publish_metrics(self) -> None:
        while True:
            try:
                self.metrics.update(self.server.stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("publishing decode metrics failed")
            await asyncio.sleep(METRICS_PERIOD_S)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Cache-aware routing: this replica's cached blocks and load (common/routing_policy)."""
        period = self.config.decode.routing.stats_period_s
        return await replica_routing_stats(self.server.loop, timeout_s=max(1.0, 2 * period))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's autoscaler reads this (signals of ``cluster.autoscaling.DecodePolicy``)."""
        max_num_seqs = self.server.config.scheduler.max_num_seqs
        return decode_autoscaling_stats(self.server.stats(), max_num_seqs)

    # -- health and introspection --------------------------------------------------------------

    def check_health(self) -> None:
        if not self.server.is_alive():
            raise RuntimeError(f"decode replica {self.replica_id}: engine or KV receiver is dead")

    def stats(self) -> dict[str, Any]:
        s = replica_stats(self.server, self.replica_id)
        s["peak_running"] = self.server.loop.peak_running
        s["prefill_retries"] = self.prefill_client.num_retries if self.prefill_client else 0
        return s

    def check_integrity(self) -> str:
        try:
            self.server.check_integrity()
        except AssertionError as e:
            return str(e)
        return "ok"

    def pid(self) -> int:
        return os.getpid()

    def release_fault(self, name: str) -> str:
        self.server.faults.release(name)
        return self.replica_id

    def arm_fault(self, spec: str) -> str:
        """Test mode: arm a fault point for its next hit on this replica (see common/faults)."""
        self.server.faults.arm(spec)
        return self.replica_id

    async def wait_paused(self, name: str, timeout: float) -> bool:
        return await asyncio.to_thread(self.server.faults.wait_paused, name, timeout)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
