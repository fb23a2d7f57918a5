"""The paged KV block pool: ref counts, block tables, hash-chained prefix cache, LRU eviction.

Mechanism only: the scheduler decides who gets blocks and when; this class does what it is told
and raises on misuse. No torch here: a block id indexes the runner's KV tensor.

Invariants (``check_integrity``):
  * every block is either free (ref 0, in the free queue) or used (ref > 0), never both;
  * a block's ref count equals the number of block tables that hold it;
  * the cache map and the per-block hashes agree, and only full, computed blocks are cached.

Free blocks that still carry a cached prefix stay addressable until they are evicted: the free
queue is LRU-ordered, blocks without content at its head (taken first), cached blocks appended
at its tail in reverse table order (a prefix's first blocks are evicted last).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockAllocationError(RuntimeError):
    """The pool cannot satisfy an allocation the caller should have checked with ``can_*``."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        # Counters for metrics (cumulative).
        self.num_evictions = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free ones, including evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """New blocks ``request_id``'s table needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(self.block_table(request_id)))

    def cached_hashes(self) -> list[int]:
        """The hashes of every block in the prefix cache (what routers index)."""
        return list(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def match_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix. Tokens are compared, so a collision misses."""
        if not self.enable_caching:
            return []
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(block_hashes):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self._block_tokens[block_id] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def num_cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """Length of the cached prefix by hash alone (routing estimates; no token check)."""
        n = 0
        for h in block_hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def can_allocate(self, num_new_blocks: int, hit_block_ids: Sequence[int] = ()) -> bool:
        # Hits that sit in the free queue leave it when taken, so they count against it too.
        revived = sum(1 for b in hit_block_ids if self._ref_counts[b] == 0)
        return num_new_blocks + revived <= len(self._free)

    # -- mutations ----------------------------------------------------------------------------

    def allocate(
        self, request_id: str, num_new_blocks: int, hit_block_ids: Sequence[int] = ()
    ) -> list[int]:
        """Create ``request_id``'s table: the prefix-cache hits (shared) then fresh blocks."""
        if request_id in self._tables:
            raise BlockAllocationError(f"request {request_id!r} already has a block table")
        if not self.can_allocate(num_new_blocks, hit_block_ids):
            raise BlockAllocationError(
                f"request {request_id!r}: {num_new_blocks} new blocks requested, "
                f"{len(self._free)} free"
            )
        table: list[int] = []
        for b in hit_block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
            table.append(b)
        table.extend(self._take_free() for _ in range(num_new_blocks))
        self._tables[request_id] = table
        return table

    def append_blocks(self, request_id: str, num_new_blocks: int) -> list[int]:
        """Grow an existing table by fresh blocks; returns the new block ids."""
        table = self._tables[request_id]
        if num_new_blocks > len(self._free):
            raise BlockAllocationError(
                f"request {request_id!r}: {num_new_blocks} more blocks requested, "
                f"{len(self._free)} free"
            )
        new = [self._take_free() for _ in range(num_new_blocks)]
        table.extend(new)
        return new

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        num_computed_tokens: int,
    ) -> None:
        """Publish the request's full, computed blocks in the prefix cache.

        Call only once the KV of those tokens is really in the blocks: a partially transferred
        or uncomputed block must never become a cache hit.
        """
        if not self.enable_caching:
            return
        table = self._tables[request_id]
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_hashes), len(table))
        for i in range(num_full):
            b = table[i]
            if self._block_hash[b] is not None:
                continue  # already published (a hit, or cached on an earlier step)
            h = block_hashes[i]
            if h in self._cached:
                continue  # another block holds this content; this one stays private
            self._block_hash[b] = h
            self._block_tokens[b] = tuple(token_ids[i * bs : (i + 1) * bs])
            self._cached[h] = b

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks nobody holds return to the free queue."""
        table = self._tables.pop(request_id)
        for b in reversed(table):
            self._ref_counts[b] -= 1
            assert self._ref_counts[b] >= 0, f"block {b} double-freed"
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:
                    self._free.move_to_end(b, last=False)  # no content: reuse first

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (e.g. after a weight reload); returns how many."""
        n = 0
        for b in list(self._free):
            if self._block_hash[b] is not None:
                self._uncache(b)
                n += 1
        return n

    def _take_free(self) -> int:
        b, _ = self._free.popitem(last=False)
        assert self._ref_counts[b] == 0
        if self._block_hash[b] is not None:
            self._uncache(b)
            self.num_evictions += 1
        self._ref_counts[b] = 1
        return b

    def _uncache(self, b: int) -> None:
        h = self._block_hash[b]
        assert h is not None
        if self._cached.get(h) == b:
            del self._cached[h]
        self._block_hash[b] = None
        self._block_tokens[b] = None

    # -- invariants ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant (leak, double free)."""
        self._check_holders()
        self._check_cache_map()
        if len(self._free) + sum(1 for c in self._ref_counts if c > 0) != self.num_blocks:
            raise AssertionError("free + used != total")

    def _check_holders(self) -> None:
        """Each block's ref count is its number of holding tables; free exactly when unheld."""
        holders = [0] * self.num_blocks
        for rid, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {rid!r} holds a block twice: {table}")
            for b in table:
                holders[b] += 1
        for b in range(self.num_blocks):
            in_free = b in self._free
            if self._ref_counts[b] != holders[b]:
                raise AssertionError(
                    f"block {b}: ref count {self._ref_counts[b]} but {holders[b]} holders"
                )
            if in_free == (holders[b] > 0):
                state = "free and held" if in_free else "neither free nor held (leaked)"
                raise AssertionError(f"block {b} is {state}")

    def _check_cache_map(self) -> None:
        """The prefix-cache map and the blocks' hashes name each other."""
        for h, b in self._cached.items():
            if self._block_hash[b] != h:
                raise AssertionError(f"cache map names block {b} for a hash it does not carry")
        for b, bh in enumerate(self._block_hash):
            if bh is not None and self._cached.get(bh) != b:
                raise AssertionError(f"block {b} carries a hash the cache map does not know")

    def stats(self) -> dict[str, float]:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "usage": self.usage,
            "num_evictions": self.num_evictions,
        }
