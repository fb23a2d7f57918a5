"""``KVPool.allocate(shared=True)``: the memfd pool is resident when allocation returns, so no
prompt's KV write page-faults inside a step (a private pool is written at allocation too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.common.kv_layout import KVLayout
from cluster.kv_transfer import KVPool

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVLayout("pdserve-test", "float32", 16, 4, 2, 64)  # 32 KiB a block


def _rss_shmem_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    pytest.skip("no RssShmem in /proc/self/status")


def test_a_shared_pool_is_resident_and_zeroed_once_allocated() -> None:
    num_blocks = 512  # 16 MiB
    before = _rss_shmem_kib()
    pool = KVPool.allocate(LAYOUT, num_blocks, shared=True)
    try:
        grown_kib = _rss_shmem_kib() - before
        nbytes = num_blocks * LAYOUT.bytes_per_block
        # Untouched, a fresh memfd adds nothing to RssShmem; written page by page, all of it.
        assert grown_kib * 1024 >= 0.95 * nbytes, (grown_kib, nbytes)
        assert pool.bytes is not None and not pool.bytes.any()  # still all zeros
    finally:
        pool.close()
