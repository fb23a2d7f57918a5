"""The prefill pool as a Ray Serve deployment: ``PrefillServer``, one ``PrefillWorker`` a replica.

Its ``prefill`` call is a stream (``Accepted``, ``PrefillProgress`` while a streamed prompt
prefills, then ``PrefillReply``) that stays open until the decode side has pulled the KV, the
lease expired, or the call was cancelled: Ray Serve counts leased work as ongoing, so scale-down
drains it (``graceful_shutdown_timeout_s`` exceeds the lease) and cancellation reaches the
lease. Health, stats, metrics, the routing and autoscaling reports and the test-mode fault hooks
come from ``serving.replica.PoolReplica``; options (replicas, CPUs, queue limits) are set by
``cluster.app`` from the config.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cluster.common.protocol import Accepted, PrefillCall, PrefillProgress, PrefillReply
from cluster.config import config_from_dict
from cluster.prefill_worker.worker import PrefillWorker
from cluster.serving.calls import Keepalive
from cluster.serving.replica import PoolReplica, bind_pool_replica, current_replica_id
from cluster.serving.signals import prefill_autoscaling_stats

logger = logging.getLogger(__name__)


@serve.deployment(name="PrefillServer")
class PrefillServer(PoolReplica):
    role = "prefill"
    worker: PrefillWorker

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = config_from_dict(config)
        self.cores = bind_pool_replica(cfg, self.role)  # first: the threads below inherit it
        replica_id = current_replica_id()
        super().__init__(cfg, replica_id, PrefillWorker(cfg, instance_id=replica_id).start())
        self.recent_requests: collections.deque[str] = collections.deque(maxlen=1024)
        logger.info("prefill replica %s: KV endpoint %s", replica_id, self.worker.endpoint)

    async def prefill(
        self, call: PrefillCall
    ) -> AsyncIterator[Accepted | PrefillProgress | PrefillReply | Keepalive]:
        self._started()
        self.recent_requests.append(call.request_id)  # where requests went (routing tests)
        yield Accepted(self.replica_id)
        async with contextlib.aclosing(self.with_keepalives(self.worker.prefill(call))) as items:
            async for reply in items:
                yield reply

    def autoscaling_signals(self, stats: dict[str, Any]) -> dict[str, float]:
        return prefill_autoscaling_stats(stats)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["recent_requests"] = list(self.recent_requests)
        return s
