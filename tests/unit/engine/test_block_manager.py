"""The paged block pool: ref counts, prefix cache, LRU eviction, integrity checks."""

from __future__ import annotations

import pytest

from cluster.common.hashing import hash_block_tokens
from cluster.engine.block_manager import BlockAllocationError, BlockManager

BS = 4


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocate_append_free_keeps_pool_whole() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    table = bm.allocate("a", 3)
    assert len(table) == 3 and bm.num_free_blocks == 5
    bm.append_blocks("a", 2)
    assert len(bm.block_table("a")) == 5 and bm.num_used_blocks == 5
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_over_allocation_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate("a", 3)
    assert not bm.can_allocate(2)
    with pytest.raises(BlockAllocationError):
        bm.allocate("b", 2)
    with pytest.raises(BlockAllocationError):
        bm.append_blocks("a", 2)
    assert not bm.has_table("b")
    bm.check_integrity()
    with pytest.raises(BlockAllocationError):
        bm.allocate("a", 0)  # one table per request


def test_prefix_hits_are_shared_by_reference_and_token_checked() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    toks = _tokens(12)
    hashes = hash_block_tokens(toks, BS)
    bm.allocate("a", 3)
    bm.cache_blocks("a", hashes, toks, num_computed_tokens=12)
    hits = bm.match_prefix(hashes, toks)
    assert hits == bm.block_table("a")
    bm.allocate("b", 1, hits)  # shares a's three blocks, plus one of its own
    assert bm.block_table("b")[:3] == hits
    bm.check_integrity()
    # Same hashes but different tokens (a collision): no hit.
    other = _tokens(12, start=100)
    assert bm.match_prefix(hashes, other) == []
    bm.free("a")
    bm.free("b")
    bm.check_integrity()
    # Freed but cached: still a hit, and taking it revives it from the free queue.
    assert bm.match_prefix(hashes, toks) == hits
    assert bm.num_free_blocks == 16
    bm.allocate("c", 0, hits)
    assert bm.num_free_blocks == 13
    bm.free("c")
    bm.check_integrity()


def test_only_computed_full_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    toks = _tokens(10)
    hashes = hash_block_tokens(toks, BS)
    assert len(hashes) == 2  # the partial third block has no hash
    bm.allocate("a", 3)
    bm.cache_blocks("a", hashes, toks, num_computed_tokens=5)  # only block 0 is computed
    assert bm.num_cached_blocks == 1
    assert len(bm.match_prefix(hashes, toks)) == 1
    bm.free("a")


def test_lru_eviction_takes_empty_blocks_first_then_oldest_cached() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    toks_a, toks_b = _tokens(8), _tokens(8, start=50)
    ha, hb = hash_block_tokens(toks_a, BS), hash_block_tokens(toks_b, BS)
    bm.allocate("a", 2)
    bm.cache_blocks("a", ha, toks_a, 8)
    bm.free("a")
    bm.allocate("b", 2)
    bm.cache_blocks("b", hb, toks_b, 8)
    bm.free("b")
    assert bm.num_cached_blocks == 4
    bm.allocate("x", 2)  # takes the two never-used blocks: nothing evicted
    assert bm.num_cached_blocks == 4 and bm.num_evictions == 0
    bm.allocate("y", 1)  # evicts the least recently freed prefix's tail block first
    assert bm.num_evictions == 1
    assert len(bm.match_prefix(ha, toks_a)) == 1  # a lost its last block, kept its first
    assert len(bm.match_prefix(hb, toks_b)) == 2
    bm.free("x")
    bm.free("y")
    bm.check_integrity()


def test_integrity_check_detects_leak_and_double_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate("a", 2)
    leaked = bm.block_table("a").pop()  # simulate a table losing a block it holds
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_integrity()
    bm.block_table("a").append(leaked)
    bm.check_integrity()
    bm.free("a")
    with pytest.raises(KeyError):
        bm.free("a")  # a second free of the same request is refused
    bm.check_integrity()


def test_reset_prefix_cache_forgets_only_evictable_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    toks = _tokens(8)
    hashes = hash_block_tokens(toks, BS)
    bm.allocate("a", 2)
    bm.cache_blocks("a", hashes, toks, 8)
    assert bm.reset_prefix_cache() == 0  # held blocks stay cached
    bm.free("a")
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(hashes, toks) == []
    bm.check_integrity()
