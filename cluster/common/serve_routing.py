"""Ray Serve request routing for the pools: least outstanding work, minus failed replicas.

Ray's ``RequestRouter`` picks, within each rank of candidates it is given, the replica with the
shortest queue (probed or cached). So "least outstanding work" is a single rank of every
candidate; a retry after a failure passes ``exclude_replicas`` in its call and those replicas
are left out (if that leaves nothing, all candidates are offered again rather than stalling).
No FIFO mixin: a routing decision serves the request it was made for, so exclusions hold.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

LEAST_LOADED_ROUTER = "cluster.common.serve_routing.LeastLoadedRouter"


def excluded_replicas(pending: PendingRequest | None) -> tuple[str, ...]:
    if pending is None or not pending.args:
        return ()
    excluded: Any = getattr(pending.args[0], "exclude_replicas", ())
    return tuple(excluded)


class LeastLoadedRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        excluded = excluded_replicas(pending_request)
        if excluded:
            kept = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded]
            if kept:
                return [kept]
        return [list(candidate_replicas)]
