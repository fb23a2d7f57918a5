"""Cache-aware routing as a pure policy (no Ray): which replica should take a prompt?

Each pool's caller (the router for the decode pool, decode replicas for the prefill pool) keeps a
``PrefixIndex``: per replica, the block hashes its prefix cache holds, from the snapshots the
replicas publish (``record_routing_stats``) plus what this caller dispatched since (optimistic:
a request's blocks will be cached where it was sent). A candidate's cost, in prompt-token
equivalents, is the work the request would wait for and cause there::

    cost = miss_cost_factor x uncached prompt tokens   (prefill it waits for, and the pool's
                                                        compute and KV spent on a prefix that
                                                        another replica may already hold)
         + queued prefill tokens on the replica        (work ahead of it)
         + queue_cost_tokens x (requests queued or in flight there)
         + transfer_cost_per_block x blocks it lacks   (decode pool: bytes that would move)

so a long cached prefix wins over a short queue, and a hot replica sheds load when the cache win
is small. Replicas under ``min_kv_headroom`` free KV go last. Equal costs share a rank, where Ray
Serve's own queue-length probing breaks the tie (least outstanding work: the fallback).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.config import RoutingConfig

SNAPSHOT_VERSION = 1


def routing_snapshot(
    hashes: Iterable[int],
    *,
    kv_free: float,
    num_running: int,
    num_waiting: int,
    queued_tokens: int,
) -> dict[str, Any]:
    """What a replica publishes (``record_routing_stats``): small, plain, msgpack/pickle-safe."""
    return {
        "v": SNAPSHOT_VERSION,
        "hashes": list(hashes),
        "kv_free": float(kv_free),
        "running": int(num_running),
        "waiting": int(num_waiting),
        "queued_tokens": int(queued_tokens),
    }


def snapshot_from_stats(hashes: Iterable[int], engine_stats: dict[str, Any]) -> dict[str, Any]:
    """A pool replica's snapshot from its engine's cached hashes and ``stats()``."""
    kv = engine_stats.get("kv", {})
    return routing_snapshot(
        hashes,
        kv_free=1.0 - float(kv.get("usage", 0.0)),
        num_running=int(engine_stats.get("num_running", 0)),
        num_waiting=int(engine_stats.get("num_waiting", 0))
        + int(engine_stats.get("num_waiting_for_kv", 0)),
        queued_tokens=int(engine_stats.get("num_queued_prefill_tokens", 0)),
    )


@dataclass
class _ReplicaState:
    cached: frozenset[int] = frozenset()
    snapshot_at: float = 0.0  # local time the current snapshot arrived
    snapshot: Any = None  # the stats object it came from (a new object on every update)
    kv_free: float = 1.0
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0
    # Optimistic: block hash -> when this caller dispatched a request with it here.
    dispatched_blocks: dict[int, float] = field(default_factory=dict)
    inflight: int = 0  # this caller's requests on the replica, not completed yet


@dataclass(frozen=True, slots=True)
class Candidate:
    replica_id: str
    cost: float
    hit_blocks: int


class PrefixIndex:
    """Which replica holds which prefix, for one pool, in one caller process."""

    def __init__(self, config: RoutingConfig, block_size: int, pool: str) -> None:
        self.config = config
        self.block_size = block_size
        self.pool = pool  # "prefill" | "decode": decode prices the blocks that would move
        self.replicas: dict[str, _ReplicaState] = {}

    # -- updates -------------------------------------------------------------------------------

    def update(
        self, replica_id: str, stats: dict[str, Any] | None, now: float | None = None
    ) -> None:
        """Take a replica's latest published snapshot (a no-op when it has not changed)."""
        state = self.replicas.setdefault(replica_id, _ReplicaState())
        if not stats or stats.get("v") != SNAPSHOT_VERSION or stats is state.snapshot:
            return
        now = time.monotonic() if now is None else now
        state.snapshot = stats
        state.cached = frozenset(stats.get("hashes", ()))
        state.snapshot_at = now
        state.kv_free = float(stats.get("kv_free", 1.0))
        state.running = int(stats.get("running", 0))
        state.waiting = int(stats.get("waiting", 0))
        state.queued_tokens = int(stats.get("queued_tokens", 0))
        # A snapshot taken well after a dispatch is authoritative about that dispatch's blocks.
        settled = now - 2 * self.config.stats_period_s
        state.dispatched_blocks = {h: t for h, t in state.dispatched_blocks.items() if t > settled}

    def dispatched(
        self, replica_id: str, block_hashes: Sequence[int], now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        state = self.replicas.setdefault(replica_id, _ReplicaState())
        for h in block_hashes:
            state.dispatched_blocks[h] = now
        state.inflight += 1

    def completed(self, replica_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that left the pool."""
        keep = set(replica_ids)
        for rid in list(self.replicas):
            if rid not in keep:
                del self.replicas[rid]

    # -- scoring -------------------------------------------------------------------------------

    def hit_blocks(self, replica_id: str, block_hashes: Sequence[int], now: float) -> int:
        state = self.replicas.get(replica_id)
        if state is None:
            return 0
        ttl = self.config.index_ttl_s
        n = 0
        for h in block_hashes:
            if h in state.cached:
                n += 1
                continue
            t = state.dispatched_blocks.get(h)
            if t is not None and now - t <= ttl:
                n += 1
                continue
            break
        return n

    def candidate(
        self, replica_id: str, block_hashes: Sequence[int], num_prompt_tokens: int, now: float
    ) -> Candidate:
        cfg = self.config
        state = self.replicas.get(replica_id) or _ReplicaState()
        hit = self.hit_blocks(replica_id, block_hashes, now)
        uncached = max(0, num_prompt_tokens - hit * self.block_size)
        # Queued there: what the replica last reported, or what this caller alone has in flight
        # there, whichever is more (the report lags; other callers are not in the count).
        queued = max(state.waiting, state.inflight)
        cost = (
            cfg.miss_cost_factor * uncached + state.queued_tokens + cfg.queue_cost_tokens * queued
        )
        if self.pool == "decode":
            cost += cfg.transfer_cost_per_block * (len(block_hashes) - hit)
        return Candidate(replica_id, float(cost), hit)

    def rank(
        self,
        replica_ids: Sequence[str],
        block_hashes: Sequence[int],
        num_prompt_tokens: int,
        now: float | None = None,
    ) -> list[list[str]]:
        """Candidates best first, equal costs sharing a rank; short on KV: last."""
        now = time.monotonic() if now is None else now
        roomy: list[Candidate] = []
        tight: list[Candidate] = []
        for rid in replica_ids:
            c = self.candidate(rid, block_hashes, num_prompt_tokens, now)
            state = self.replicas.get(rid)
            full = state is not None and state.kv_free < self.config.min_kv_headroom
            (tight if full else roomy).append(c)
        ranks: list[list[str]] = []
        for group in (roomy, tight):
            group.sort(key=lambda c: c.cost)
            head: Candidate | None = None
            for c in group:
                if head is not None and abs(c.cost - head.cost) < 1e-9:
                    ranks[-1].append(c.replica_id)
                else:
                    head = c
                    ranks.append([c.replica_id])
        return ranks
