"""A real sender process killed before or during a transfer (F2, F3), and a torch_dist peer
that never receives (F21): a clear error within the timeout, never a partial DONE."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.common.kv_layout import KVLayout
from cluster.kv_transfer import KVReceiver
from cluster.kv_transfer.protocol import KVTransferError, Reason, TransferState
from tests.harness.kv_faults import FaultRule, FaultyTransport
from tests.harness.kv_sender_peer import FaultySenderProcess
from tests.unit.kv_transfer.helpers import BIG, SEED, SMALL, assert_landed, crcs, transfer_config

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 1.0
NIGHTLY = [pytest.param(20, marks=pytest.mark.nightly, id="nightly")]


def _spawn(n: int, layout: KVLayout, **spec: object) -> list[FaultySenderProcess]:
    base = {
        "layout": dataclasses.asdict(layout),
        "num_blocks": 32,
        "seed": SEED,
        "transfer": {"transports": ["zmq"], "transfer_timeout_s": TIMEOUT_S},
    }
    base.update(spec)
    with ThreadPoolExecutor(n) as pool:  # start-up is mostly `import torch`: overlap it
        return list(pool.map(lambda _: FaultySenderProcess(base), range(n)))


def _check_failed_cleanly(
    receiver: KVReceiver, proc: FaultySenderProcess, dst: list[int], before: list[int], hold: bool
) -> None:
    params = proc.register("doomed", list(range(8)), num_tokens=128)
    if hold:
        receiver.hold(params)  # a connection exists when the sender dies
        time.sleep(0.1)
    proc.kill()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, dst)
    assert time.monotonic() - t0 <= TIMEOUT_S + 0.5
    assert e.value.reason in (Reason.TIMEOUT, Reason.PEER_DISCONNECTED)
    assert receiver.state(params.transfer_id) is TransferState.FAILED
    after = crcs(receiver.pool)
    assert after == before  # killed before the pull: nothing was written


@pytest.mark.parametrize("runs", [3, *NIGHTLY])
def test_sender_killed_before_the_pull(make_receiver: Callable[..., KVReceiver], runs: int) -> None:
    """F2: the error surfaces within transfer timeout + 0.5 s; the receiver keeps serving."""
    procs = _spawn(runs + 1, SMALL)
    survivor = procs.pop()
    receiver = make_receiver(transfer_config(transports=("zmq",), transfer_timeout_s=TIMEOUT_S))
    before = crcs(receiver.pool)
    for i, proc in enumerate(procs):
        _check_failed_cleanly(receiver, proc, list(range(40, 48)), before, hold=i % 2 == 0)
    params = survivor.register("alive", [1, 2], num_tokens=32)
    receiver.pull(params, [3, 4])
    assert_landed(receiver.pool, [1, 2], [3, 4], before)
    survivor.close()


@pytest.mark.parametrize("runs", [3, *NIGHTLY])
def test_sender_killed_mid_transfer_never_reports_done(
    make_receiver: Callable[..., KVReceiver], runs: int
) -> None:
    """F3: SIGKILL at the 4th of 8 frames: the pull fails, the partial blocks are not DONE."""
    procs = _spawn(runs, BIG, faults=["p.mid_send_frame_k:4=kill"])
    cfg = transfer_config(transports=("zmq",), transfer_timeout_s=TIMEOUT_S, frame_bytes=1 << 16)
    receiver = make_receiver(cfg, layout=BIG)
    dst = list(range(40, 48))
    for proc in procs:
        before = crcs(receiver.pool)
        params = proc.register("half", list(range(8)), num_tokens=128)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            receiver.pull(params, dst)
        assert time.monotonic() - t0 <= TIMEOUT_S + 0.5
        assert e.value.reason in (Reason.TIMEOUT, Reason.PEER_DISCONNECTED)
        assert receiver.state(params.transfer_id) is TransferState.FAILED
        assert proc.proc.wait(timeout=10) == -9  # it really died at the fault point
        after = crcs(receiver.pool)
        outside = [b for b in range(receiver.pool.num_blocks) if b not in dst]
        assert [after[b] for b in outside] == [before[b] for b in outside]
        proc.close()


@pytest.mark.parametrize("runs", [1, *NIGHTLY])
def test_torch_dist_peer_that_never_receives(
    make_receiver: Callable[..., KVReceiver], runs: int
) -> None:
    """F21 on gloo: the receiver drops the Ready (so never posts its recv); the pull fails on
    the control-plane timeout, the pair is aborted and rebuilt; the next pull succeeds."""
    (proc,) = _spawn(
        1, SMALL, transfer={"transports": ["torch_dist"], "transfer_timeout_s": TIMEOUT_S}
    )
    faults = FaultyTransport([])
    cfg = transfer_config(transports=("torch_dist",), transfer_timeout_s=TIMEOUT_S)
    receiver = make_receiver(cfg, faults=faults)
    for i in range(runs):
        before = crcs(receiver.pool)
        faults.set_rules([FaultRule("drop", tag="ready", direction="recv")])
        stuck = proc.register(f"stuck-{i}", [1, 2], num_tokens=32)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            receiver.pull(stuck, [5, 6])
        assert e.value.reason == Reason.TIMEOUT
        assert time.monotonic() - t0 <= TIMEOUT_S + 1.0
        faults.set_rules([])
        ok = proc.register(f"ok-{i}", [3, 4], num_tokens=32)
        assert receiver.pull(ok, [7, 8], timeout_s=10).transport == "torch_dist"
        assert_landed(receiver.pool, [3, 4], [7, 8], before)
        st = proc.wait_until(lambda s, i=i: [f"stuck-{i}", "peer_aborted"] in s["released"])
        assert [f"stuck-{i}", "peer_aborted"] in st["released"]
    proc.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shm needs memfd (Linux)")
def test_shm_pull_from_a_killed_sender_fails_cleanly(
    make_receiver: Callable[..., KVReceiver],
) -> None:
    (proc,) = _spawn(
        1, SMALL, shared=True, transfer={"transports": ["shm"], "transfer_timeout_s": TIMEOUT_S}
    )
    receiver = make_receiver(transfer_config(transports=("shm",), transfer_timeout_s=TIMEOUT_S))
    before = crcs(receiver.pool)
    ok = proc.register("first", [1, 2], num_tokens=32)
    assert receiver.pull(ok, [3, 4]).transport == "shm"
    assert_landed(receiver.pool, [1, 2], [3, 4], before)
    _check_failed_cleanly(
        receiver, proc, [10, 11, 12, 13, 14, 15, 16, 17], crcs(receiver.pool), True
    )
