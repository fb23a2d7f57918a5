"""The pools' Serve request routers: which ranks they hand Ray, and in what order.

Ray takes, within a rank, the first replica whose queue is strictly shorter than those before
it, so the order inside a rank decides where idle-time traffic goes. These tests call
``choose_replicas`` directly with stand-in replicas (only the attributes the routers read).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any

from cluster.common.protocol import GenerateCall
from cluster.common.sampling_params import SamplingParams
from cluster.serving.routers import CacheAwareRouter, LeastLoadedRouter


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass
class _Replica:
    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> _Id:
        return _Id(self.name)


def _pending(call: GenerateCall) -> Any:
    return type("Pending", (), {"args": (call,)})()


def _call(block_hashes: list[int], exclude: tuple[str, ...] = ()) -> GenerateCall:
    return GenerateCall(
        request_id="r",
        prompt_token_ids=list(range(16 * len(block_hashes) + 3)),
        block_hashes=block_hashes,
        params=SamplingParams(max_tokens=4),
        exclude_replicas=exclude,
    )


def _choose(router: Any, replicas: list[_Replica], pending: Any) -> list[list[str]]:
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def _least_loaded() -> LeastLoadedRouter:
    # Ray's constructor wires the router to a deployment; choose_replicas needs none of it.
    return object.__new__(LeastLoadedRouter)


def _cache_aware() -> CacheAwareRouter:
    router = object.__new__(CacheAwareRouter)
    router.initialize_state(routing={}, block_size=16, pool="decode")
    return router


def test_least_loaded_puts_each_replica_first_in_turn() -> None:
    replicas = [_Replica(n) for n in "abc"]
    firsts: collections.Counter[str] = collections.Counter()
    for _ in range(300):
        (rank,) = _choose(_least_loaded(), replicas, None)
        assert sorted(rank) == ["a", "b", "c"]
        firsts[rank[0]] += 1
    # 100 expected each; a fixed order would give 300 to one replica.
    assert set(firsts) == {"a", "b", "c"}
    assert min(firsts.values()) >= 50, firsts


def test_cache_aware_spreads_ties_and_keeps_the_cached_replica_first() -> None:
    router = _cache_aware()
    replicas = [_Replica(n) for n in "abcd"]
    hashes = [11, 12, 13, 14]
    router.index.dispatched("a", hashes)  # "a" has the prompt's blocks...
    router.index.completed("a")  # ...and nothing in flight
    firsts_after_a: collections.Counter[str] = collections.Counter()
    for _ in range(300):
        ranks = _choose(router, replicas, _pending(_call(hashes)))
        assert ranks[0] == ["a"], ranks
        rest = [rid for rank in ranks[1:] for rid in rank]
        assert sorted(rest) == ["b", "c", "d"]
        firsts_after_a[rest[0]] += 1
    assert set(firsts_after_a) == {"b", "c", "d"}
    assert min(firsts_after_a.values()) >= 50, firsts_after_a


def test_an_excluded_replica_is_left_out_and_the_rest_still_spread() -> None:
    replicas = [_Replica(n) for n in "abc"]
    firsts: collections.Counter[str] = collections.Counter()
    for router in (_least_loaded(), _cache_aware()):
        for _ in range(200):
            ranks = _choose(router, replicas, _pending(_call([21, 22], exclude=("a",))))
            flat = [rid for rank in ranks for rid in rank]
            assert sorted(flat) == ["b", "c"], ranks
            firsts[flat[0]] += 1
    assert min(firsts["b"], firsts["c"]) >= 100, firsts
