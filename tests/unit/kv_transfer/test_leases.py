"""Leases with an injectable clock: reaping (F7), mass expiry (F5), heartbeats (F6)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from cluster.kv_transfer import KVReceiver
from cluster.kv_transfer.leases import LeaseState, LeaseTable
from tests.unit.kv_transfer.conftest import SenderHandle
from tests.unit.kv_transfer.helpers import FakeClock, transfer_config

F5_LEASES = int(os.environ.get("PDSERVE_F5_LEASES", "1000"))


def test_reaper_frees_every_expired_lease_behind_a_live_head() -> None:
    """F7: A (oldest, renewed), B and C (expired): one pass reaps B and C."""
    clock = FakeClock()
    table = LeaseTable(1.0, clock)
    table.add("A", "ta", (1,))
    table.add("B", "tb", (2,))
    table.add("C", "tc", (3,))
    clock.advance(0.9)
    assert table.renew("ta")
    clock.advance(0.2)
    expired = {lease.request_id for lease in table.expired()}
    assert expired == {"B", "C"}
    for lease in table.expired():
        table.remove(lease.transfer_id)
    assert [lease.request_id for lease in table] == ["A"]
    assert table.is_finished("tb") and not table.is_finished("ta")


def test_leases_in_flight_or_draining_do_not_expire_or_renew() -> None:
    clock = FakeClock()
    table = LeaseTable(1.0, clock)
    lease = table.add("A", "ta", (1,))
    lease.state = LeaseState.SENDING
    clock.advance(5)
    assert table.expired() == []  # a transport is reading: never reaped mid-read
    lease.state = LeaseState.DRAINING
    assert not table.renew("ta")


def test_duplicate_request_or_transfer_ids_are_refused() -> None:
    table = LeaseTable(1.0, FakeClock())
    table.add("A", "ta", (1,))
    with pytest.raises(ValueError, match="request_id"):
        table.add("A", "tb", (2,))
    table.remove("ta")
    with pytest.raises(ValueError, match="transfer_id"):
        table.add("B", "ta", (2,))  # a finished transfer id is never reused


def test_mass_expiry_on_a_live_sender(make_sender: Callable[..., SenderHandle]) -> None:
    """F5: 1000 leases never pulled -> all released as expired, counter == 1000, 0 leaked."""
    clock = FakeClock()
    h = make_sender(transfer_config(lease_s=30.0, heartbeat_s=5.0), num_blocks=8, clock=clock)
    for i in range(F5_LEASES):
        h.sender.register(f"lost-{i}", [i % 8], num_tokens=1)
    assert h.sender.num_active_leases == F5_LEASES
    time.sleep(0.2)
    assert h.released == []  # nothing expires before its time
    clock.advance(30.01)
    released = h.wait_released(F5_LEASES, timeout=10)
    assert len(released) == F5_LEASES
    assert {why for _, why in released} == {"expired"}
    assert len({rid for rid, _ in released}) == F5_LEASES  # each exactly once
    st = h.sender.stats()
    assert st["leases_expired"] == F5_LEASES and st["leases_active"] == 0
    assert h.sender.num_active_leases == 0


def _tick(clock: FakeClock, receiver: KVReceiver, seconds: float = 0.21) -> None:
    """Advance fake time by one heartbeat period and let both threads act on it."""
    sent = receiver.stats().get("heartbeats_sent", 0)
    clock.advance(seconds)
    deadline = time.monotonic() + 0.5  # a late loop may send it on the next tick: harmless
    while receiver.stats().get("heartbeats_sent", 0) == sent and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.03)  # the sender renews (and reaps) before time moves on


def test_heartbeats_renew_on_the_fake_clock(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    """F6 with one clock for both sides: 10 leases held for 5 x the lease, none expires."""
    clock = FakeClock()
    cfg = transfer_config(transports=("zmq",))
    h = make_sender(cfg, clock=clock)
    receiver = make_receiver(cfg, clock=clock)
    handles = [h.sender.register(f"q-{i}", [i], num_tokens=16) for i in range(10)]
    for p in handles:
        receiver.hold(p)
    for _ in range(24):  # 24 x 0.21 s of fake time: 5 leases
        _tick(clock, receiver)
    assert h.released == []
    for i, p in enumerate(handles):
        receiver.pull(p, [40 + i])
    assert sorted(h.wait_released(10)) == sorted((f"q-{i}", "acked") for i in range(10))
    assert h.sender.stats().get("leases_expired", 0) == 0


def test_only_the_lease_without_heartbeats_expires(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    clock = FakeClock()
    cfg = transfer_config(transports=("zmq",))
    h = make_sender(cfg, clock=clock)
    receiver = make_receiver(cfg, clock=clock)
    kept = h.sender.register("kept", [1], num_tokens=16)
    h.sender.register("unheld", [2], num_tokens=16)
    receiver.hold(kept)
    for _ in range(8):  # 1.6 leases
        _tick(clock, receiver)
    assert h.wait_released(1) == [("unheld", "expired")]
    receiver.abort(kept, reason="client cancelled")
    assert h.wait_released(2) == [("unheld", "expired"), ("kept", "peer_aborted")]
