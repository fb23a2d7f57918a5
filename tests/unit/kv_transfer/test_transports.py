"""Every transport, two real processes on loopback: the KV received is bit-identical to the KV
sent, in the right blocks, nothing else written, leases released (acceptance 1 and 2)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest

from benchmarks.kv_sender_peer import SenderProcess
from cluster.common.kv_layout import KVLayout
from cluster.kv_transfer import KVReceiver
from cluster.kv_transfer.protocol import KVTransferError, Reason, TransferState
from tests.unit.kv_transfer.helpers import (
    BIG,
    SEED,
    SMALL,
    assert_landed,
    crcs,
    transfer_config,
)

pytestmark = pytest.mark.timeout(120)

# (name, receiver preference, zmq over ipc)
PATHS = [
    ("zmq_tcp", ("zmq",), False),
    ("zmq_ipc", ("zmq",), True),
    ("shm", ("shm",), True),
    ("torch_dist", ("torch_dist",), True),
]


@pytest.fixture(scope="module", params=[SMALL, BIG], ids=["small_blocks", "big_blocks"])
def sender_proc(request: pytest.FixtureRequest) -> Iterator[SenderProcess]:
    """One child process offering every transport (shared pool, zmq, a rendezvous store)."""
    layout: KVLayout = request.param
    proc = SenderProcess(
        {
            "layout": dataclasses.asdict(layout),
            "num_blocks": 64,
            "shared": True,
            "seed": SEED,
            "transfer": {
                "transports": ["shm", "zmq", "torch_dist"],
                "lease_s": 1.0,
                "heartbeat_s": 0.2,
                "transfer_timeout_s": 5.0,
            },
        }
    )
    proc.layout = layout  # type: ignore[attr-defined]
    yield proc
    st = proc.stats()
    assert st["alive"] and st["stats"].get("internal_errors", 0) == 0
    proc.close()


def _receiver(
    make_receiver: Callable[..., KVReceiver], sender_proc: SenderProcess, path: tuple
) -> KVReceiver:
    _, transports, ipc = path
    layout = sender_proc.layout  # type: ignore[attr-defined]
    return make_receiver(
        transfer_config(transports=transports, ipc=ipc, transfer_timeout_s=5.0), layout=layout
    )


@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_pull_lands_bit_identical_in_the_right_blocks(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver], path: tuple
) -> None:
    receiver = _receiver(make_receiver, sender_proc, path)
    pool = receiver.pool
    before = crcs(pool)
    # Source runs 3-6, 10-11, 20, 30, 31; destination scattered differently.
    src = [3, 4, 5, 6, 10, 11, 20, 30, 31]
    dst = [40, 41, 2, 3, 9, 10, 11, 50, 51]
    params = sender_proc.register(f"bit-{path[0]}", src, num_tokens=len(src) * 16 - 5)
    result = receiver.pull(params, dst)
    assert result.transport == path[1][0]
    assert result.num_blocks == len(src)
    assert result.num_bytes == len(src) * pool.bytes_per_block
    assert receiver.state(params.transfer_id) is TransferState.DONE
    assert_landed(pool, src, dst, before)
    st = sender_proc.wait_until(lambda s: [f"bit-{path[0]}", "acked"] in s["released"])
    assert [f"bit-{path[0]}", "acked"] in st["released"]


@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_incremental_pull_moves_only_the_missing_blocks(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver], path: tuple
) -> None:
    receiver = _receiver(make_receiver, sender_proc, path)
    pool = receiver.pool
    src = list(range(12, 22))  # 10 blocks on the sender
    reservation = list(range(30, 40))  # the decode side's table: the first 4 are cached hits
    k = 4
    before = crcs(pool)
    sent_before = sender_proc.stats()["stats"].get("blocks_sent", 0)
    params = sender_proc.register(f"inc-{path[0]}", src, num_tokens=160)
    result = receiver.pull(params, reservation[k:], first_block=k)
    assert result.num_blocks == len(src) - k
    assert receiver.stats()["blocks_received"] == len(src) - k
    assert receiver.stats()["bytes_received"] == (len(src) - k) * pool.bytes_per_block
    st = sender_proc.wait_until(lambda s: [f"inc-{path[0]}", "acked"] in s["released"])
    assert st["stats"]["blocks_sent"] - sent_before == len(src) - k
    assert_landed(pool, src[k:], reservation[k:], before)  # the cached 4 stay untouched


def test_concurrent_pulls_share_one_connection(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver]
) -> None:
    receiver = _receiver(make_receiver, sender_proc, PATHS[1])
    pool = receiver.pool
    before = crcs(pool)
    futures, plans = [], []
    for i in range(6):
        src = [8 * i + j for j in range(4)]
        dst = [63 - (4 * i + j) for j in range(4)]
        params = sender_proc.register(f"conc-{i}", src, num_tokens=64)
        futures.append(receiver.pull_async(params, dst))
        plans.append((src, dst))
    for f in futures:
        assert f.result(timeout=10).num_blocks == 4
    assert_landed(pool, [s for p in plans for s in p[0]], [d for p in plans for d in p[1]], before)
    assert receiver.stats()["connections_opened"] == 1


def test_heartbeats_keep_queued_leases_alive_past_the_lease(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver]
) -> None:
    """F6: 20 requests wait 2.5 x the lease while heartbeating; none expires, all pull."""
    receiver = _receiver(make_receiver, sender_proc, PATHS[1])
    handles = [sender_proc.register(f"f6-{i}", [i, i + 20], num_tokens=32) for i in range(20)]
    for p in handles:
        receiver.hold(p)
    time.sleep(2.5)  # lease 1.0 s, heartbeat 0.2 s
    for i, p in enumerate(handles):
        receiver.pull(p, [2 * i, 2 * i + 1])
    st = sender_proc.wait_until(lambda s: sum(r[0].startswith("f6-") for r in s["released"]) == 20)
    f6 = sorted(r for r in st["released"] if r[0].startswith("f6-"))
    assert f6 == sorted([f"f6-{i}", "acked"] for i in range(20))  # none "expired"
    assert receiver.stats().get("leases_lost", 0) == 0


def test_unpulled_lease_expires_then_a_late_pull_is_stale(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver]
) -> None:
    receiver = _receiver(make_receiver, sender_proc, PATHS[0])
    params = sender_proc.register("late", [1, 2], num_tokens=20)
    st = sender_proc.wait_until(lambda s: ["late", "expired"] in s["released"], timeout=5)
    assert ["late", "expired"] in st["released"]
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, [5, 6])
    assert e.value.reason == Reason.STALE_TRANSFER


def test_receiver_abort_frees_the_sender_lease(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver]
) -> None:
    receiver = _receiver(make_receiver, sender_proc, PATHS[1])
    params = sender_proc.register("d-abort", [1, 2], num_tokens=20)
    receiver.hold(params)
    receiver.abort(params)
    st = sender_proc.wait_until(lambda s: ["d-abort", "peer_aborted"] in s["released"])
    assert ["d-abort", "peer_aborted"] in st["released"]


def test_sender_abort_releases_and_the_pull_fails_cleanly(
    sender_proc: SenderProcess, make_receiver: Callable[..., KVReceiver]
) -> None:
    receiver = _receiver(make_receiver, sender_proc, PATHS[1])
    before = crcs(receiver.pool)
    params = sender_proc.register("p-abort", [1, 2], num_tokens=20)
    assert sender_proc.call({"op": "abort", "request_id": "p-abort"})["ok"]
    st = sender_proc.wait_until(lambda s: ["p-abort", "aborted"] in s["released"])
    assert ["p-abort", "aborted"] in st["released"]
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, [5, 6])
    assert e.value.reason == Reason.STALE_TRANSFER
    assert crcs(receiver.pool) == before
