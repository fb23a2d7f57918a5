"""Fixtures for the data-plane tests: senders and receivers that are always closed, with a leak
check at the end of each test (threads alive, no internal errors, 0 active leases)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks.kv_sender_peer import fill_pattern
from cluster.common.kv_layout import KVLayout
from cluster.config import TransferConfig
from cluster.kv_transfer import KVPool, KVReceiver, KVSender
from cluster.kv_transfer.framing import WireFaults
from tests.unit.kv_transfer.helpers import SEED, SMALL, SenderHandle, transfer_config


@pytest.fixture
def make_sender() -> Iterator[Callable[..., SenderHandle]]:
    made: list[SenderHandle] = []

    def make(
        config: TransferConfig | None = None,
        *,
        layout: KVLayout = SMALL,
        num_blocks: int = 64,
        shared: bool = False,
        faults: WireFaults | None = None,
        **kw: Any,
    ) -> SenderHandle:
        pool = KVPool.allocate(layout, num_blocks, shared=shared)
        fill_pattern(pool, SEED)
        released: list[tuple[str, str]] = []
        sender = KVSender(
            config or transfer_config(),
            pool,
            on_release=lambda rid, why: released.append((rid, why)),
            faults=faults,
            **kw,
        )
        sender.start()
        handle = SenderHandle(sender, pool, released)
        made.append(handle)
        return handle

    yield make
    for h in made:
        assert h.sender.is_alive(), "the serving thread died"
        assert h.sender.stats().get("internal_errors", 0) == 0
        h.sender.close()
        assert h.sender.num_active_leases == 0


@pytest.fixture
def make_receiver() -> Iterator[Callable[..., KVReceiver]]:
    made: list[KVReceiver] = []

    def make(
        config: TransferConfig | None = None,
        *,
        layout: KVLayout = SMALL,
        num_blocks: int = 64,
        **kw: Any,
    ) -> KVReceiver:
        pool = KVPool.allocate(layout, num_blocks)
        receiver = KVReceiver(config or transfer_config(), pool, **kw)
        receiver.start()
        made.append(receiver)
        return receiver

    yield make
    for r in made:
        assert r.is_alive(), "the receiver thread died"
        assert r.stats().get("internal_errors", 0) == 0
        r.close()
