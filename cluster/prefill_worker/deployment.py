"""The prefill pool as a Ray Serve deployment: a ``PrefillServer`` per replica.

Its ``prefill`` call is a stream (``Accepted``, then ``PrefillReply``) that stays open until the
decode side has pulled the KV, the lease expired, or the call was cancelled: Ray Serve counts
leased work as ongoing, so scale-down drains it (``graceful_shutdown_timeout_s`` exceeds the
lease) and cancellation reaches the lease. Options (replicas, CPUs, queue limits) are set by
``cluster.app`` from the config.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cluster.common.autoscaling_stats import prefill_autoscaling_stats
from cluster.common.metrics import PoolMetrics
from cluster.common.protocol import Accepted, PrefillCall, PrefillReply
from cluster.common.routing_policy import replica_routing_stats
from cluster.common.serve_calls import replica_stats
from cluster.config import config_from_dict
from cluster.prefill_worker.server import PrefillServer

logger = logging.getLogger(__name__)
METRICS_PERIOD_S = 1.0


@serve.deployment(name="PrefillServer")
class PrefillDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config_from_dict(config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.server = PrefillServer(self.config, instance_id=self.replica_id).start()
        self.metrics = PoolMetrics("prefill")
        self._metrics_task: asyncio.Task[None] | None = None
        self.recent_requests: collections.deque[str] = collections.deque(maxlen=1024)
        logger.info("prefill replica %s: KV endpoint %s", self.replica_id, self.server.endpoint)

    async def prefill(self, call: PrefillCall) -> AsyncIterator[Accepted | PrefillReply]:
        self._ensure_metrics_task()
        self.recent_requests.append(call.request_id)  # where requests went (routing tests)
        yield Accepted(self.replica_id)
        async for reply in self.server.prefill(call):
            yield reply

    def _ensure_metrics_task(self) -> None:
        if self._metrics_task is None:
            self._metrics_task = asyncio.get_running_loop().create_task(self._publish_metrics())

    async def _publish_metrics(self) -> None:
        while True:
            try:
                self.metrics.update(self.server.stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("publishing prefill metrics failed")
            await asyncio.sleep(METRICS_PERIOD_S)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Cache-aware routing: this replica's cached blocks and load (common/routing_policy)."""
        period = self.config.prefill.routing.stats_period_s
        return await replica_routing_stats(self.server.loop, timeout_s=max(1.0, 2 * period))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's autoscaler reads this (signals of ``cluster.autoscaling.PrefillPolicy``)."""
        return prefill_autoscaling_stats(self.server.stats())

    # -- health and introspection --------------------------------------------------------------

    def check_health(self) -> None:
        if not self.server.is_alive():
            raise RuntimeError(f"prefill replica {self.replica_id}: engine or KV sender is dead")

    def stats(self) -> dict[str, Any]:
        s = replica_stats(self.server, self.replica_id)
        s["recent_requests"] = list(self.recent_requests)
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
        # Graceful shutdown: Serve has already waited for open streams (leases) to end.
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
