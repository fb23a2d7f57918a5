"""Helpers for the data-plane tests: small layouts, test timings, a fake clock, block checks."""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.kv_sender_peer import pattern_block
from cluster.common.kv_layout import KVLayout
from cluster.config import TransferConfig
from cluster.kv_transfer import KVPool, KVSender

# 8 KiB blocks (below pyzmq's zero-copy threshold: frames pack several) and 128 KiB blocks.
SMALL = KVLayout("pdserve-test", "float32", 16, 2, 2, 16)
BIG = KVLayout("pdserve-test", "float32", 16, 8, 2, 64)
SEED = 7

torch.set_num_threads(1)


def transfer_config(**overrides: Any) -> TransferConfig:
    """the reliability matrix's test timings: lease 1 s, heartbeat 0.2 s, transfer timeout 1 s."""
    base = TransferConfig(lease_s=1.0, heartbeat_s=0.2, transfer_timeout_s=1.0)
    return dataclasses.replace(base, **overrides)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def crcs(pool: KVPool) -> list[int]:
    assert pool.bytes is not None
    return [zlib.crc32(pool.bytes[b]) for b in range(pool.num_blocks)]


def assert_landed(
    pool: KVPool,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    before: list[int],
    seed: int = SEED,
) -> None:
    """The right source blocks are in the right destination blocks; nothing else changed."""
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected = pattern_block(pool.layout, seed, s)[0]
        assert torch.equal(pool.tensor[d], expected), f"block {s} -> {d} differs"
    after = crcs(pool)
    touched = set(dst_ids)
    changed = [b for b in range(pool.num_blocks) if b not in touched and after[b] != before[b]]
    assert not changed, f"blocks outside the destination changed: {changed}"


def assert_untouched(pool: KVPool, before: list[int]) -> None:
    after = crcs(pool)
    changed = [b for b in range(pool.num_blocks) if after[b] != before[b]]
    assert not changed, f"blocks written by a refused transfer: {changed}"


@dataclasses.dataclass
class SenderHandle:
    sender: KVSender
    pool: KVPool
    released: list[tuple[str, str]]

    def wait_released(self, n: int, timeout: float = 5.0) -> list[tuple[str, str]]:
        import time

        deadline = time.monotonic() + timeout
        while len(self.released) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.released)
