"""Streamed leases (protocol 2): a lease that grows while its prefill runs is pulled in parts
(``PullRequest.final`` False), every block exactly once, the lease held between parts, and only
the final pull of a sealed lease ends it; misuse is refused with a reason."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from cluster.kv_transfer import KVReceiver, KVTransferError, TransferState
from cluster.kv_transfer.protocol import PullRequest, Reason, decode, encode
from tests.unit.kv_transfer.helpers import (
    SenderHandle,
    assert_landed,
    assert_untouched,
    crcs,
    transfer_config,
)

pytestmark = pytest.mark.timeout(60)

PATHS = {"zmq": (("zmq",), False), "shm": (("shm",), True), "loopback": (("loopback",), False)}


def _pair(
    make_sender: Callable[..., SenderHandle],
    make_receiver: Callable[..., KVReceiver],
    path: str,
    **cfg: object,
) -> tuple[SenderHandle, KVReceiver]:
    transports, shared = PATHS[path]
    config = transfer_config(transports=transports, **cfg)
    return make_sender(config, shared=shared), make_receiver(config)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_streamed_lease_moves_in_parts_each_block_once(
    make_sender: Callable[..., SenderHandle],
    make_receiver: Callable[..., KVReceiver],
    path: str,
) -> None:
    s, receiver = _pair(make_sender, make_receiver, path)
    before = crcs(receiver.pool)
    src, dst = [4, 5, 9, 10, 12], [30, 31, 2, 40, 41]
    p1 = s.sender.register("r", src[:2], num_tokens=32, streamed=True)
    part = receiver.pull(p1, dst[:2], final=False)
    assert part.state is TransferState.TRANSFERRING and part.num_blocks == 2
    p2 = s.sender.extend("r", src[:4], num_tokens=64)
    assert p2 is not None and p2.transfer_id == p1.transfer_id
    receiver.pull(p2, dst[2:4], first_block=2, final=False)
    assert s.released == []  # the parts left the lease in place
    p3 = s.sender.extend("r", src, num_tokens=70, last=True)
    assert p3 is not None
    done = receiver.pull(p3, dst[4:], first_block=4)
    assert done.state is TransferState.DONE and done.num_blocks == 1
    assert s.wait_released(1) == [("r", "acked")]
    assert_landed(receiver.pool, src, dst, before)
    sent, got = s.sender.stats(), receiver.stats()
    assert sent["pulls_served"] == 3 and sent["blocks_sent"] == 5 and sent["parts_acked"] == 2
    assert got["parts_ok"] == 2 and got["transfers_ok"] == 1 and got["blocks_received"] == 5


def test_the_lease_survives_between_parts_past_lease_s(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    s, receiver = _pair(make_sender, make_receiver, "zmq")  # lease 1 s, heartbeat 0.2 s
    p1 = s.sender.register("r", [1, 2], num_tokens=32, streamed=True)
    receiver.pull(p1, [7, 8], final=False)
    time.sleep(2.0)  # a long chunk: the receiver heartbeats the lease meanwhile
    assert s.released == [] and s.sender.num_active_leases == 1
    p2 = s.sender.extend("r", [1, 2, 3], num_tokens=40, last=True)
    assert p2 is not None
    receiver.pull(p2, [9], first_block=2)
    assert s.wait_released(1) == [("r", "acked")]


def test_a_block_is_never_pulled_twice(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    s, receiver = _pair(make_sender, make_receiver, "zmq")
    p1 = s.sender.register("r", [1, 2], num_tokens=32, streamed=True)
    receiver.pull(p1, [7, 8], final=False)
    p2 = s.sender.extend("r", [1, 2, 3], num_tokens=48)
    assert p2 is not None
    before = crcs(receiver.pool)
    with pytest.raises(KVTransferError) as e:
        receiver.pull(p2, [20, 21], first_block=1, final=False)  # block 2 again
    assert e.value.reason == Reason.DUPLICATE
    assert_untouched(receiver.pool, before)
    assert s.wait_released(1) == [("r", "peer_aborted")]  # the receiver gave it up
    assert s.sender.stats()["rejected"][Reason.DUPLICATE] == 1


def test_a_final_pull_of_a_growing_lease_is_refused(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    s, receiver = _pair(make_sender, make_receiver, "zmq")
    p1 = s.sender.register("r", [1, 2], num_tokens=32, streamed=True)
    before = crcs(receiver.pool)
    with pytest.raises(KVTransferError) as e:
        receiver.pull(p1, [7, 8])  # final=True while the prefill still runs
    assert e.value.reason == Reason.STREAM_OPEN
    assert_untouched(receiver.pool, before)
    assert s.wait_released(1) == [("r", "peer_aborted")]


def test_extend_refuses_what_is_not_a_growing_prefix(
    make_sender: Callable[..., SenderHandle],
) -> None:
    s = make_sender(transfer_config(transports=("zmq",)))
    s.sender.register("bulk", [1, 2], num_tokens=32)
    with pytest.raises(ValueError, match="not a growing one"):
        s.sender.extend("bulk", [1, 2, 3], num_tokens=48)
    s.sender.register("r", [4, 5], num_tokens=32, streamed=True)
    with pytest.raises(ValueError, match="must start with the blocks already leased"):
        s.sender.extend("r", [5, 4, 6], num_tokens=48)
    with pytest.raises(ValueError, match="block_ids"):
        s.sender.extend("r", [4, 5, 5000], num_tokens=48)
    assert s.sender.abort("r") and s.sender.abort("bulk")
    s.wait_released(2)
    assert s.sender.extend("r", [4, 5, 6], num_tokens=48) is None  # the lease is gone


def test_pull_request_carries_final_on_the_wire() -> None:
    part = PullRequest(3, "t", "r", 1, "zmq", (((1, 2),),), False, 0, final=False)
    assert decode(encode(part)) == part
    assert PullRequest(3, "t", "r", 1, "zmq", (((1, 2),),), False, 0).final  # the default
