"""Ray Serve request routing for the pools: cache-aware, or least outstanding work.

Ray's ``RequestRouter`` picks, within each rank of candidates it is given, the replica with the
shortest queue (probed or cached), and moves to the next rank when a whole rank is at capacity.

* ``LeastLoadedRouter``: a single rank of every candidate (least outstanding work).
* ``RoundRobinRouter``: each replica in turn (a benchmark baseline).
* ``CacheAwareRouter``: ranks from ``routing_policy.PrefixIndex`` (cached prefix against queued
  work and KV headroom; see that module), fed by the snapshots replicas publish through
  ``record_routing_stats`` every ``routing.stats_period_s`` and by this caller's own dispatches.

Ray picks, among the replicas of a rank, the first one whose queue length is strictly shorter
than those before it; so replicas that tie (idle ones, most of the time) would all lose to the
first in the list, and a replica that joins the pool (a replacement, a scale-up) would get no
traffic until the first one was busy. Each rank is therefore handed over in a random order
(``spread_ties``): equal replicas share the load, and the ranking between ranks is kept.

Both leave out the replicas a retry excludes (``exclude_replicas`` in the call; if that leaves
nothing, every candidate is offered again rather than stalling). No FIFO mixin: a routing
decision serves the request it was made for, so exclusions hold.
"""

from __future__ import annotations

import collections
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.common.protocol import GenerateCall, PrefillCall
from cluster.config import RoutingConfig
from cluster.serving.routing_policy import PrefixIndex

LEAST_LOADED_ROUTER = "cluster.serving.routers.LeastLoadedRouter"
CACHE_AWARE_ROUTER = "cluster.serving.routers.CacheAwareRouter"
ROUND_ROBIN_ROUTER = "cluster.serving.routers.RoundRobinRouter"


PoolCall = GenerateCall | PrefillCall

# Milliseconds each cache-aware routing decision took in this process (index update + scoring),
# the latest ones: what a deployed caller reports in its stats (``bench routing``).
_RANKING_MS: collections.deque[float] = collections.deque(maxlen=4096)


# The order ties are broken in: its own generator, so that nothing else's seeding fixes it.
_TIES = random.Random()


def spread_ties(rank: list[RunningReplica]) -> list[RunningReplica]:
    """A copy of one rank in random order, so that Ray's first-shortest pick spreads ties."""
    shuffled = list(rank)
    _TIES.shuffle(shuffled)
    return shuffled


def recent_ranking_ms() -> list[float]:
    return list(_RANKING_MS)


def _call(pending: PendingRequest | None) -> PoolCall | None:
    """The pool call a request carries (its first argument), or None for any other method."""
    if pending is None or not pending.args:
        return None
    call = pending.args[0]
    return call if isinstance(call, GenerateCall | PrefillCall) else None


def excluded_replicas(pending: PendingRequest | None) -> tuple[str, ...]:
    call = _call(pending)
    return tuple(call.exclude_replicas) if call is not None else ()


def _without_excluded(
    candidates: list[RunningReplica], pending: PendingRequest | None
) -> list[RunningReplica]:
    excluded = excluded_replicas(pending)
    if excluded:
        kept = [r for r in candidates if r.replica_id.unique_id not in excluded]
        if kept:
            return kept
    return list(candidates)


class LeastLoadedRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return [spread_ties(_without_excluded(candidate_replicas, pending_request))]


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, whatever it holds (the baseline ``pdserve bench routing`` beats)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        candidates = sorted(
            _without_excluded(candidate_replicas, pending_request),
            key=lambda r: r.replica_id.unique_id,
        )
        self.turn += 1
        k = self.turn % len(candidates)
        return [[r] for r in candidates[k:] + candidates[:k]]


class CacheAwareRouter(RequestRouter):
    index: PrefixIndex

    def initialize_state(self, **kwargs: Any) -> None:
        routing = RoutingConfig(**kwargs.get("routing", {}))
        self.index = PrefixIndex(routing, int(kwargs.get("block_size", 16)), kwargs["pool"])
        self.num_routed = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        candidates = _without_excluded(candidate_replicas, pending_request)
        call = _call(pending_request)
        if call is None or not call.block_hashes or len(candidates) < 2:
            return [spread_ties(candidates)]
        t0 = time.perf_counter()
        by_id = {r.replica_id.unique_id: r for r in candidates}
        for rid, replica in by_id.items():
            self.index.update(rid, replica.routing_stats)
        ranks = self.index.rank(list(by_id), call.block_hashes, len(call.prompt_token_ids))
        _RANKING_MS.append((time.perf_counter() - t0) * 1000)
        return [spread_ties([by_id[rid] for rid in rank]) for rank in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        call = _call(pending_request)
        if call is not None and call.block_hashes:
            self.index.dispatched(replica_id.unique_id, call.block_hashes)
            self.num_routed += 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self.index.completed(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.retain(r.replica_id.unique_id for r in replicas)
