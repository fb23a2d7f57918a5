"""Scripted wire faults (reliability matrix K1, K5-K8, F19): every case ends in a clear error or a
clean success, the threads alive, 0 leaked leases, no write outside the request's blocks."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest

from cluster.kv_transfer import KVReceiver
from cluster.kv_transfer.protocol import KVTransferError, Reason, TransferState
from tests.harness.kv_faults import FaultRule, FaultyTransport
from tests.serve_fixtures import wait_until
from tests.unit.kv_transfer.conftest import SenderHandle
from tests.unit.kv_transfer.helpers import assert_landed, assert_untouched, crcs, transfer_config

pytestmark = pytest.mark.timeout(60)

# Frames of 64 KiB, so a message of at most one: the cases below address chunks one by one.
CFG = transfer_config(transports=("zmq",), frame_bytes=1 << 16)
SRC = list(range(0, 32, 2))  # 16 scattered 8 KiB blocks: two 64 KiB frames, two chunks
DST = list(range(32, 48))
GROUPED = transfer_config(transports=("zmq",))  # the default: both frames in one message

Make = Callable[..., SenderHandle]
MakeR = Callable[..., KVReceiver]


def _pull_fails(receiver: KVReceiver, h: SenderHandle, rid: str, reason: str) -> None:
    before = crcs(receiver.pool)
    num_released = len(h.released)
    params = h.sender.register(rid, SRC, num_tokens=16 * 16)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, DST)
    assert e.value.reason == reason, e.value
    assert time.monotonic() - t0 < CFG.transfer_timeout_s + 0.5
    assert receiver.state(params.transfer_id) is TransferState.FAILED
    assert_untouched(receiver.pool, before) if reason != Reason.TIMEOUT else None
    # The receiver told the sender: the lease is freed now (a timeout may race the expiry).
    released = dict(h.wait_released(num_released + 1))
    assert released[rid] in (
        ("peer_aborted", "expired") if reason == Reason.TIMEOUT else ("peer_aborted",)
    )


def _pull_works(receiver: KVReceiver, h: SenderHandle, rid: str) -> None:
    before = crcs(receiver.pool)
    params = h.sender.register(rid, SRC, num_tokens=16 * 16)
    assert receiver.pull(params, DST).num_blocks == len(SRC)
    assert_landed(receiver.pool, SRC, DST, before)


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        (FaultRule("truncate", frame=0, nbytes=100), Reason.BAD_FRAMES),
        (FaultRule("drop_frame", frame=0), Reason.BAD_FRAMES),
        (FaultRule("extra_frame", nbytes=8), Reason.BAD_FRAMES),
        (FaultRule("drop", nth=1), Reason.BAD_FRAMES),  # the 2nd chunk shows the gap
        (FaultRule("drop", nth=2), Reason.TIMEOUT),  # the last chunk never comes
    ],
    ids=["truncate", "missing_frame", "extra_frame", "missing_first_chunk", "missing_last"],
)
def test_damaged_chunks_fail_the_pull_before_any_write(
    make_sender: Make, make_receiver: MakeR, rule: FaultRule, reason: str
) -> None:
    """K1: truncated, missing and extra frames are caught by count and length checks."""
    h = make_sender(CFG, faults=FaultyTransport([rule]))
    receiver = make_receiver(CFG)
    _pull_fails(receiver, h, "bad", reason)
    assert receiver.stats()["failures"][reason] == 1
    _pull_works(receiver, h, "next")  # the same connection serves the next transfer


@pytest.mark.parametrize(
    "rule",
    [
        None,
        FaultRule("truncate", frame=1, nbytes=100),
        FaultRule("drop_frame", frame=1),
        FaultRule("extra_frame", nbytes=8),
    ],
    ids=["intact", "truncate_second", "missing_second", "extra"],
)
def test_frames_grouped_in_one_message_land_or_fail_before_any_write(
    make_sender: Make, make_receiver: MakeR, rule: FaultRule | None
) -> None:
    """The default frame size groups the two frames into one chunk of two parts: it lands
    whole, or a damaged part fails the pull before either part is written."""
    h = make_sender(GROUPED, faults=FaultyTransport([rule] if rule else []))
    receiver = make_receiver(GROUPED)
    if rule is None:
        _pull_works(receiver, h, "grouped")
    else:
        _pull_fails(receiver, h, "grouped", Reason.BAD_FRAMES)
        _pull_works(receiver, h, "next")
    # The sender counts a pull once it has queued the frames: the pull may land before that.
    want = 1 if rule is None else 2
    wait_until(lambda: h.sender.stats().get("pulls_served", 0) >= want, timeout=10, interval=0.01)
    assert h.sender.stats().get("pulls_served", 0) == want


def test_a_duplicated_chunk_is_dropped_and_counted(make_sender: Make, make_receiver: MakeR) -> None:
    h = make_sender(CFG, faults=FaultyTransport([FaultRule("duplicate", nth=1)]))
    receiver = make_receiver(CFG)
    _pull_works(receiver, h, "dup")
    assert receiver.stats()["rejected"] == {Reason.DUPLICATE: 1}


def test_a_delayed_chunk_still_lands(make_sender: Make, make_receiver: MakeR) -> None:
    h = make_sender(CFG, faults=FaultyTransport([FaultRule("delay", nth=1, delay_s=0.3)]))
    receiver = make_receiver(CFG)
    _pull_works(receiver, h, "slow")


def test_bit_flips_are_caught_in_checksum_mode(make_sender: Make, make_receiver: MakeR) -> None:
    """K8: with transfer.checksum, one flipped payload bit fails the pull; 100 % detected."""
    cfg = transfer_config(transports=("zmq",), checksum=True)
    rules = [FaultRule("flip", nth=n, frame=0, bit=977 * n) for n in range(1, 11)]
    h = make_sender(cfg, faults=FaultyTransport(rules))
    receiver = make_receiver(cfg)
    for i in range(5):  # each pull sends 2 chunks; every one is flipped
        _pull_fails(receiver, h, f"flip-{i}", Reason.CHECKSUM)
    assert receiver.stats()["failures"][Reason.CHECKSUM] == 5


def test_replayed_pull_is_dropped_and_the_original_succeeds(
    make_sender: Make, make_receiver: MakeR
) -> None:
    """K5: the pull request arrives twice; the replay is refused, the transfer unaffected."""
    h = make_sender(CFG)
    receiver = make_receiver(
        CFG, faults=FaultyTransport([FaultRule("duplicate", tag="pull", direction="send")])
    )
    _pull_works(receiver, h, "replayed")
    assert h.wait_released(1) == [("replayed", "acked")]
    assert h.sender.stats()["rejected"] == {Reason.DUPLICATE: 1}


def test_duplicate_ack_is_ignored_and_counted(make_sender: Make, make_receiver: MakeR) -> None:
    """K6: a second 'transfer done' for a released lease is counted, nothing else happens."""
    h = make_sender(CFG)
    rules = [FaultRule("duplicate", tag="ack", direction="send", nth=n) for n in (1, 2, 3)]
    receiver = make_receiver(CFG, faults=FaultyTransport(rules))
    for i in range(3):
        _pull_works(receiver, h, f"acked-{i}")
    time.sleep(0.2)
    assert h.sender.stats()["rejected"] == {Reason.STALE_ACK: 3}
    assert sorted(h.released) == [(f"acked-{i}", "acked") for i in range(3)]


def test_oversized_frame_drops_the_connection_then_reconnects(
    make_sender: Make, make_receiver: MakeR
) -> None:
    """K7: a frame over max_message_bytes is cut by zmq before allocation; reconnect works."""
    cfg = transfer_config(transports=("zmq",), max_message_bytes=1 << 20)
    rule = FaultRule("oversize", frame=0, nbytes=(1 << 20) + 1)
    h = make_sender(cfg, faults=FaultyTransport([rule]))
    receiver = make_receiver(cfg)
    rss = psutil.Process().memory_info().rss
    _pull_fails(receiver, h, "huge", Reason.PEER_DISCONNECTED)
    assert psutil.Process().memory_info().rss - rss < 2 * (1 << 20)
    _pull_works(receiver, h, "after")


def test_partition_times_out_expires_the_lease_and_heals(
    make_sender: Make, make_receiver: MakeR
) -> None:
    """F19: blackhole both directions: the pull times out, the unrenewed lease expires on
    the sender; after the heal new transfers succeed; nothing leaks."""
    faults = FaultyTransport([])
    h = make_sender(CFG, faults=faults)
    receiver = make_receiver(CFG)
    _pull_works(receiver, h, "before")
    faults.set_rules(
        [FaultRule("blackhole", tag="*"), FaultRule("blackhole", "*", direction="recv")]
    )
    params = h.sender.register("cut", SRC, num_tokens=256)
    receiver.hold(params)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, DST)
    assert e.value.reason == Reason.TIMEOUT
    assert time.monotonic() - t0 < CFG.transfer_timeout_s + 0.5
    assert ("cut", "expired") in h.wait_released(2, timeout=CFG.lease_s + 2)
    faults.set_rules([])
    _pull_works(receiver, h, "after")
    assert h.wait_released(3)[-1] == ("after", "acked")
    assert h.sender.num_active_leases == 0


def test_aborting_a_transfer_mid_flight_frees_both_sides(
    make_sender: Make, make_receiver: MakeR
) -> None:
    h = make_sender(CFG, faults=FaultyTransport([FaultRule("delay", nth=1, delay_s=0.5)]))
    receiver = make_receiver(CFG)
    params = h.sender.register("cancel", SRC, num_tokens=256)
    future = receiver.pull_async(params, DST)
    time.sleep(0.1)
    receiver.abort(params, reason="client cancelled")
    with pytest.raises(KVTransferError) as e:
        future.result(timeout=5)
    assert e.value.reason == Reason.ABORTED
    assert h.wait_released(1) == [("cancel", "peer_aborted")]
    _pull_works(receiver, h, "next")


@pytest.mark.parametrize("injections", [1000, pytest.param(10000, marks=pytest.mark.nightly)])
def test_damaged_chunk_storm_leaves_everything_serving(
    make_sender: Make, make_receiver: MakeR, injections: int
) -> None:
    """K1 at count: every damaged transfer ends terminal and fast, the receiver thread lives,
    no lease leaks, and blocks outside the destination are never written."""
    faults = FaultyTransport([])
    h = make_sender(CFG, faults=faults)
    receiver = make_receiver(CFG)
    # One 64 KiB frame per pull, so no chunk of a failed pull is still on its way when the
    # next pull's rule is armed.
    src, dst = SRC[:8], DST[:8]
    outside = [b for b in range(receiver.pool.num_blocks) if b not in dst]
    before = crcs(receiver.pool)
    kinds = [
        FaultRule("truncate", frame=0, nbytes=10),
        FaultRule("drop_frame", frame=0),
        FaultRule("extra_frame", nbytes=3),
    ]
    for i in range(injections):
        faults.set_rules([kinds[i % len(kinds)]])
        params = h.sender.register(f"storm-{i}", src, num_tokens=128)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            receiver.pull(params, dst)
        assert e.value.reason == Reason.BAD_FRAMES
        assert time.monotonic() - t0 < 1.5
    after = crcs(receiver.pool)
    assert [after[b] for b in outside] == [before[b] for b in outside]
    assert receiver.stats()["failures"][Reason.BAD_FRAMES] == injections
    assert len(h.wait_released(injections)) == injections
    assert h.sender.num_active_leases == 0
    faults.set_rules([])
    _pull_works(receiver, h, "after-storm")
