"""Cache-aware routing as a pure policy: prefix groups stick, hot replicas shed small wins."""

from __future__ import annotations

from cluster.common.hashing import hash_block_tokens
from cluster.config import RoutingConfig
from cluster.serving.routing_policy import PrefixIndex, routing_snapshot

BLOCK = 16


def prompt(group: int, n: int, tail: int = 0) -> list[int]:
    return [1 + (group * 97 + j * 13) % 900 for j in range(n)] + [2 + tail] * 8


def snap(hashes: list[int], **kw: float) -> dict:
    base = {"kv_free": 0.9, "num_running": 0, "num_waiting": 0, "queued_tokens": 0}
    return routing_snapshot(hashes, **{**base, **kw})  # type: ignore[arg-type]


def index(pool: str = "prefill", **cfg: float) -> PrefixIndex:
    return PrefixIndex(RoutingConfig(**cfg), BLOCK, pool)  # type: ignore[arg-type]


def test_longest_cached_prefix_wins() -> None:
    idx = index()
    p = prompt(1, 512)
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("a", snap(hashes[:4]), now=0)
    idx.update("b", snap(hashes[:30]), now=0)
    idx.update("c", snap([]), now=0)
    assert idx.rank(["a", "b", "c"], hashes, len(p), now=1) == [["b"], ["a"], ["c"]]
    assert idx.hit_blocks("b", hashes, 1) == 30


def test_a_hash_not_on_the_chain_does_not_count() -> None:
    idx = index()
    p = prompt(1, 64)
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("a", snap(hashes[1:]), now=0)  # blocks 1.. without block 0: no prefix hit
    assert idx.hit_blocks("a", hashes, 1) == 0


def test_unknown_replicas_tie_and_ray_breaks_the_tie() -> None:
    idx = index()
    hashes = hash_block_tokens(prompt(2, 64), BLOCK)
    assert idx.rank(["a", "b"], hashes, 72, now=0) == [["a", "b"]]


def test_dispatch_is_optimistic_so_a_group_sticks_before_any_snapshot() -> None:
    idx = index()
    first = prompt(3, 512, tail=1)
    idx.dispatched("b", hash_block_tokens(first, BLOCK), now=0)
    second = prompt(3, 512, tail=2)  # same 512-token prefix, another question
    ranks = idx.rank(["a", "b"], hash_block_tokens(second, BLOCK), len(second), now=0.1)
    assert ranks[0] == ["b"]


def test_optimistic_entries_expire_and_snapshots_settle_them() -> None:
    idx = index(index_ttl_s=5.0, stats_period_s=0.5)
    hashes = hash_block_tokens(prompt(4, 256), BLOCK)
    idx.dispatched("a", hashes, now=0)
    assert idx.hit_blocks("a", hashes, 4.0) == len(hashes)
    assert idx.hit_blocks("a", hashes, 6.0) == 0  # past the TTL
    idx.dispatched("a", hashes, now=10)
    idx.update("a", snap(hashes[:3]), now=10.2)  # too soon to settle the dispatch
    assert idx.hit_blocks("a", hashes, 10.3) == len(hashes)
    idx.update("a", snap(hashes[:3], kv_free=0.8), now=12)  # a later snapshot is authoritative
    assert idx.hit_blocks("a", hashes, 12.1) == 3


def test_hot_replica_sheds_load_when_the_cache_win_is_small() -> None:
    idx = index(queue_cost_tokens=256)
    p = prompt(5, 40)  # 2 full blocks cached: a 32-token win
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("hot", snap(hashes, num_waiting=3), now=0)
    idx.update("cold", snap([]), now=0)
    assert idx.rank(["hot", "cold"], hashes, len(p), now=1)[0] == ["cold"]
    # ... but keeps it when the win is large (512 cached tokens against one queued request)
    long = prompt(6, 520)
    long_hashes = hash_block_tokens(long, BLOCK)
    idx.update("hot", snap(long_hashes, num_waiting=1), now=2)
    assert idx.rank(["hot", "cold"], long_hashes, len(long), now=3)[0] == ["hot"]


def test_queued_prefill_tokens_count_as_work_ahead() -> None:
    idx = index()
    p = prompt(7, 200)
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("a", snap(hashes[:5], queued_tokens=4000), now=0)
    idx.update("b", snap([], queued_tokens=0), now=0)
    assert idx.rank(["a", "b"], hashes, len(p), now=1)[0] == ["b"]


def test_requests_in_flight_add_queue_cost_until_completed() -> None:
    idx = index(queue_cost_tokens=100)
    p = prompt(8, 64)
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("a", snap([]), now=0)
    idx.update("b", snap([]), now=0)
    idx.dispatched("a", [123], now=1)
    assert idx.rank(["a", "b"], hashes, len(p), now=1.1) == [["b"], ["a"]]
    idx.completed("a")
    assert idx.rank(["a", "b"], hashes, len(p), now=1.2) == [["a", "b"]]


def test_short_on_kv_goes_last_whatever_its_cache() -> None:
    idx = index(min_kv_headroom=0.1)
    p = prompt(9, 256)
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("full", snap(hashes, kv_free=0.02), now=0)
    idx.update("roomy", snap([]), now=0)
    assert idx.rank(["full", "roomy"], hashes, len(p), now=1) == [["roomy"], ["full"]]


def test_decode_pool_prices_the_blocks_that_would_move() -> None:
    p = prompt(10, 160)
    hashes = hash_block_tokens(p, BLOCK)
    uncached = len(p) - 4 * BLOCK  # 168 tokens, 4 blocks cached
    for pool, moved in (("prefill", 0.0), ("decode", 2.0 * (10 - 4))):
        idx = index(pool, transfer_cost_per_block=2.0, miss_cost_factor=2.0)
        idx.update("a", snap(hashes[:4]), now=0)
        assert idx.candidate("a", hashes, len(p), now=1).cost == 2.0 * uncached + moved


def test_replicas_that_left_are_forgotten() -> None:
    idx = index()
    idx.update("a", snap([1]), now=0)
    idx.update("b", snap([2]), now=0)
    idx.retain(["b"])
    assert set(idx.replicas) == {"b"}


def test_round_robin_router_takes_turns() -> None:
    import asyncio
    from types import SimpleNamespace

    from cluster.serving.routers import RoundRobinRouter

    router = RoundRobinRouter.__new__(RoundRobinRouter)  # the policy only, no Serve plumbing
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in "abc"]
    firsts = [
        asyncio.run(router.choose_replicas(replicas))[0][0].replica_id.unique_id for _ in range(6)
    ]  # type: ignore[arg-type]
    assert firsts == ["b", "c", "a", "b", "c", "a"]


def test_a_cache_holder_keeps_its_group_against_one_request_in_flight() -> None:
    # The group's previous request is still prefilling on "a": waiting for it there costs about
    # what a cold replica would, but the cold one would compute and cache the prefix again.
    idx = index()
    p = prompt(11, 512, tail=3)
    hashes = hash_block_tokens(p, BLOCK)
    idx.update("a", snap([], queued_tokens=len(p)), now=0)
    idx.update("b", snap([]), now=0)
    idx.dispatched("a", hashes[:-1], now=0.1)
    assert idx.rank(["a", "b"], hashes, len(p), now=0.2)[0] == ["a"]
    # With misses priced like any other token it would move (the old trade-off).
    flat = index(miss_cost_factor=1.0)
    flat.update("a", snap([], queued_tokens=len(p)), now=0)
    flat.update("b", snap([]), now=0)
    flat.dispatched("a", hashes[:-1], now=0.1)
    assert flat.rank(["a", "b"], hashes, len(p), now=0.2)[0] == ["b"]
