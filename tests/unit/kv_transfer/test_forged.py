"""Forged messages from rogue peers (reliability matrix K3, K4, K5, K9, S2, S10): refused with a
reason before any write, counted, and the real sender or receiver keeps serving afterwards."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from benchmarks.kv_sender_peer import pattern_block
from cluster.common.kv_layout import KVLayout
from cluster.kv_transfer import KVReceiver
from cluster.kv_transfer.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Chunk,
    HelloReply,
    KVTransferError,
    PullError,
    PullRequest,
    Reason,
    encode,
)
from cluster.kv_transfer.security import host_id
from tests.unit.kv_transfer.conftest import SenderHandle
from tests.unit.kv_transfer.helpers import (
    SEED,
    SMALL,
    assert_landed,
    assert_untouched,
    crcs,
    transfer_config,
)
from tests.unit.kv_transfer.rogue import RogueClient, RogueSender

pytestmark = pytest.mark.timeout(60)
CFG = transfer_config(transports=("zmq",))
BPB = SMALL.bytes_per_block


def _chunk(pull: PullRequest, frame: int, data: bytes, nbytes: int | None = None) -> list[bytes]:
    header = Chunk(pull.pull_id, frame, (len(data) if nbytes is None else nbytes,), ())
    return [encode(header), data]


# -- a rogue sender against the real receiver (K3) --------------------------------------------


def _good_frame(pull: PullRequest) -> bytes:
    (segments,) = pull.frames
    return b"".join(
        pattern_block(SMALL, SEED, s + i).numpy().tobytes() for s, n in segments for i in range(n)
    )


FORGERIES: dict[str, Callable[[PullRequest], list[list[bytes]]]] = {
    "shape_not_bytes": lambda p: [_chunk(p, 0, _good_frame(p)[:-4])],
    "declared_not_sent": lambda p: [_chunk(p, 0, _good_frame(p), nbytes=BPB)],
    "more_blocks_than_planned": lambda p: [_chunk(p, 0, _good_frame(p) + bytes(BPB))],
    "frame_count": lambda p: [[*_chunk(p, 0, _good_frame(p)), b"x" * 10]],
    "frame_index_out_of_plan": lambda p: [_chunk(p, 5, _good_frame(p))],
    "foreign_pull_id": lambda p: [
        [encode(Chunk(p.pull_id + 99, 0, (2 * BPB,), ())), _good_frame(p)]
    ],
    "float64_payload": lambda p: [_chunk(p, 0, _good_frame(p) * 2)],
    "pickle_instead_of_header": lambda p: [[pickle.dumps({"t": "chunk"}), _good_frame(p)]],
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_data_is_rejected_before_any_write(
    make_receiver: Callable[..., KVReceiver], name: str
) -> None:
    rogue = RogueSender(SMALL, FORGERIES[name])
    try:
        receiver = make_receiver(CFG)
        before = crcs(receiver.pool)
        with pytest.raises(KVTransferError) as e:
            receiver.pull(rogue.params([3, 4]), [10, 11])
        assert e.value.reason in (Reason.BAD_FRAMES, Reason.TIMEOUT)
        assert_untouched(receiver.pool, before)
        assert receiver.stats()["rejected_total"] >= 1
    finally:
        rogue.close()


def test_a_valid_rogue_answer_lands(make_receiver: Callable[..., KVReceiver]) -> None:
    """Control for the forgeries above: the same rogue with honest data succeeds."""
    rogue = RogueSender(SMALL, lambda p: [_chunk(p, 0, _good_frame(p))])
    try:
        receiver = make_receiver(CFG)
        before = crcs(receiver.pool)
        receiver.pull(rogue.params([3, 4]), [10, 11])
        assert_landed(receiver.pool, [3, 4], [10, 11], before)
    finally:
        rogue.close()


def test_a_hostile_shm_path_is_refused_without_blocking_and_the_pair_falls_back(
    make_receiver: Callable[..., KVReceiver], tmp_path: Path
) -> None:
    """S10: a same-host rogue offers shm naming a FIFO with no writer (opening it would block
    the receiver's I/O thread). The receiver refuses the path at once and uses zmq instead;
    with shm alone the pull fails fast with no_transport naming the problem."""
    fifo = tmp_path / "pdserve-kv-pool"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # keeps the link alive, never a writer
    hostile = {
        "transports": ("shm", "zmq"),
        "host_id": host_id(),
        "pid": os.getpid(),
        "shm_name": f"/proc/{os.getpid()}/fd/{reader}",
    }
    rogue = RogueSender(SMALL, lambda p: [_chunk(p, 0, _good_frame(p))], reply_fields=hostile)
    try:
        receiver = make_receiver(transfer_config(transports=("shm", "zmq")))
        before = crcs(receiver.pool)
        t0 = time.monotonic()
        assert receiver.pull(rogue.params([3, 4]), [10, 11]).transport == "zmq"
        assert time.monotonic() - t0 < 0.5
        assert_landed(receiver.pool, [3, 4], [10, 11], before)
        only_shm = make_receiver(transfer_config(transports=("shm",)))
        with pytest.raises(KVTransferError, match="not a regular file") as e:
            only_shm.pull(rogue.params([3, 4], "rogue-2"), [10, 11])
        assert e.value.reason == Reason.NO_TRANSPORT
    finally:
        with contextlib.suppress(OSError):  # release an open that did block (the unfixed case)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        rogue.close()
        os.close(reader)


def test_layout_mismatch_fails_fast_at_the_handshake(
    make_receiver: Callable[..., KVReceiver],
) -> None:
    """K9: the handle claims our layout but the peer's handshake says float16: refused."""
    other = KVLayout("pdserve-test", "float16", 16, 2, 2, 16)
    rogue = RogueSender(SMALL, lambda p: [], hello_layout=other)
    try:
        receiver = make_receiver(CFG)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            receiver.pull(rogue.params([3]), [10])
        assert e.value.reason == Reason.LAYOUT_MISMATCH and "dtype" in str(e.value)
        assert time.monotonic() - t0 < 0.5
        assert not any(m.TAG == "pull" for m in rogue.seen)  # no pull was ever sent
    finally:
        rogue.close()


def test_a_handle_with_another_layout_is_refused_before_connecting(
    make_receiver: Callable[..., KVReceiver],
) -> None:
    receiver = make_receiver(CFG)
    rogue = RogueSender(KVLayout("pdserve-test", "float32", 32, 2, 2, 16), lambda p: [])
    try:
        with pytest.raises(KVTransferError) as e:
            receiver.pull(rogue.params([3]), [10])
        assert e.value.reason == Reason.LAYOUT_MISMATCH and "block_size" in str(e.value)
    finally:
        rogue.close()


def test_destinations_outside_the_pool_or_owned_by_another_pull_are_refused(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    """K4 (receiver side): the reservation is checked before anything is requested."""
    h = make_sender(CFG)
    receiver = make_receiver(CFG)
    before = crcs(receiver.pool)
    params = h.sender.register("r", [1, 2], num_tokens=32)
    for dst, first in (([64, 1], 0), ([-1, 1], 0), ([5, 5], 0), ([5], 0), ([5, 6], 2)):
        with pytest.raises(KVTransferError) as e:
            receiver.pull(params, dst, first_block=first)
        assert e.value.reason == Reason.BAD_DESTINATION
    # Two pulls may not fill the same blocks at once (the first needs a round trip to land;
    # the second is admitted on the same I/O thread right after it).
    slow = h.sender.register("slow", [3, 4], num_tokens=32)
    first = receiver.pull_async(slow, [20, 21])
    second = receiver.pull_async(params, [21, 22])
    with pytest.raises(KVTransferError) as e:
        second.result(timeout=5)
    assert e.value.reason == Reason.BAD_DESTINATION
    first.result(timeout=5)
    receiver.pull(params, [21, 22])  # now free
    assert_landed(receiver.pool, [3, 1, 2], [20, 21, 22], before)


# -- a rogue receiver against the real sender (K4, K5, K6, version) ---------------------------


@pytest.fixture
def rogue_client(make_sender: Callable[..., SenderHandle]) -> tuple[SenderHandle, RogueClient]:
    h = make_sender(CFG)
    client = RogueClient(h.sender.endpoint)
    yield h, client
    client.close()


def test_forged_pulls_are_refused_with_a_reason(
    rogue_client: tuple[SenderHandle, RogueClient],
) -> None:
    h, client = rogue_client
    params = h.sender.register("victim", [4, 5], num_tokens=32)
    other = h.sender.register("other", [6], num_tokens=16)

    def pull(pull_id: int, frames: tuple, **kw: object) -> PullRequest:
        base: dict = dict(
            pull_id=pull_id,
            transfer_id=params.transfer_id,
            request_id="victim",
            epoch=0,
            transport="zmq",
            frames=frames,
            checksum=False,
            dist_generation=0,
        )
        base.update(kw)
        return PullRequest(**base)

    client.send(pull(1, (((4, 2),),)))
    reply = client.recv()
    assert isinstance(reply, PullError) and reply.reason == Reason.NO_HANDSHAKE
    client.handshake(SMALL)
    cases = [
        (pull(2, (((60, 10),),)), Reason.BAD_BLOCKS),  # outside the pool
        (pull(3, (((6, 1),),)), Reason.BAD_BLOCKS),  # another request's block
        (pull(4, (((4, 1),), ((4, 1),))), Reason.BAD_BLOCKS),  # the same block twice
        (pull(5, (((4, 2),),), epoch=9), Reason.STALE_EPOCH),
        (pull(6, (((4, 2),),), transfer_id="f" * 32), Reason.UNKNOWN_TRANSFER),
        (pull(7, (((4, 2),),), request_id="other"), Reason.UNKNOWN_TRANSFER),
        (pull(8, (((4, 2),),), transport="rdma"), Reason.NO_TRANSPORT),
    ]
    for msg, reason in cases:
        client.send(msg)
        reply = client.recv()
        assert isinstance(reply, PullError) and reply.reason == reason, (msg, reply)
    assert "blocks_sent" not in h.sender.stats()  # nothing was served
    assert h.sender.num_active_leases == 2  # the victims' leases are intact
    h.sender.abort("victim")
    h.sender.abort("other")
    del other


def test_replays_after_the_transfer_ended_are_stale(
    rogue_client: tuple[SenderHandle, RogueClient],
) -> None:
    """K5: 100 replays of a finished pull, and stale acks (K6): refused and counted."""
    h, client = rogue_client
    client.handshake(SMALL)
    params = h.sender.register("done", [4, 5], num_tokens=32)
    request = PullRequest(1, params.transfer_id, "done", 0, "zmq", (((4, 2),),), False, 0)
    client.send(request)
    chunk = client.recv()
    assert isinstance(chunk, Chunk)
    client.send(Ack(1, params.transfer_id))
    assert h.wait_released(1) == [("done", "acked")]
    for _ in range(100):
        client.send(request)
    for _ in range(5):
        client.send(Ack(1, params.transfer_id))
    deadline = time.monotonic() + 5
    while h.sender.stats()["rejected_total"] < 105 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.sender.stats()["rejected"] == {Reason.STALE_TRANSFER: 100, Reason.STALE_ACK: 5}
    assert h.sender.num_active_leases == 0


def test_another_protocol_version_is_refused_at_once(
    rogue_client: tuple[SenderHandle, RogueClient],
) -> None:
    _, client = rogue_client
    hello = {"t": "hello", "v": PROTOCOL_VERSION + 1, "anything": "goes"}
    client.send(parts=[msgpack.packb(hello)])
    reply = client.recv()
    assert isinstance(reply, HelloReply) and not reply.ok and reply.reason == Reason.BAD_VERSION


def test_a_layout_this_side_cannot_read_is_refused_at_once(
    rogue_client: tuple[SenderHandle, RogueClient], make_receiver: Callable[..., KVReceiver]
) -> None:
    """A peer's layout with a dtype (or a field) this side does not know is a layout
    mismatch, answered at the handshake, both ways: the sender refuses such a Hello, and a
    receiver fails at once on such a HelloReply (no wait for a timeout)."""
    _, client = rogue_client
    layout = {**dataclasses.asdict(SMALL), "dtype": "float4"}
    hello = {"t": "hello", "v": PROTOCOL_VERSION, "instance_id": "r", "host_id": "h", "pid": 1}
    client.send(parts=[msgpack.packb({**hello, "layout": layout, "transports": ["zmq"]})])
    reply = client.recv()
    assert isinstance(reply, HelloReply) and not reply.ok
    assert reply.reason == Reason.LAYOUT_MISMATCH and "float4" in reply.message

    unknown = KVLayout("pdserve-test", "float16", 16, 2, 2, 16)
    object.__setattr__(unknown, "dtype", "float4")  # what a newer sender could announce
    rogue = RogueSender(SMALL, lambda p: [], hello_layout=unknown)
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            make_receiver(CFG).pull(rogue.params([3]), [10])
        assert e.value.reason == Reason.LAYOUT_MISMATCH and "float4" in str(e.value)
        assert time.monotonic() - t0 < 0.5
    finally:
        rogue.close()


def test_pickle_payloads_to_every_endpoint_run_nothing(
    make_sender: Callable[..., SenderHandle],
    make_receiver: Callable[..., KVReceiver],
    tmp_path: Path,
) -> None:
    """S2: a pickle gadget sent to the sender's tcp and ipc endpoints (and, from a rogue
    sender, to a receiver) is refused as malformed; the sentinel file never appears."""
    sentinel = tmp_path / "pwned"

    class Gadget:
        def __reduce__(self) -> tuple:
            return (Path.touch, (sentinel,))

    payload = pickle.dumps(Gadget())
    h = make_sender(CFG)
    for endpoint in (h.sender.endpoint, h.sender.ipc_endpoint):
        client = RogueClient(endpoint)
        client.send(parts=[payload])
        client.send(parts=[payload, payload])
        client.handshake(SMALL)  # the sender still answers
        client.send(parts=[payload])
        client.close()
    rogue = RogueSender(SMALL, lambda p: [[payload], [payload, payload]])
    receiver = make_receiver(CFG)
    with pytest.raises(KVTransferError):
        receiver.pull(rogue.params([1]), [2])
    rogue.close()
    time.sleep(0.2)
    assert not sentinel.exists()
    assert h.sender.stats()["rejected"][Reason.MALFORMED] == 6
    assert receiver.stats()["rejected"][Reason.MALFORMED] >= 2
    # Both still serve honest traffic.
    receiver.pull(h.sender.register("honest", [1, 2], num_tokens=32), [3, 4])
