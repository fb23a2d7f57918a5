"""The transport interface: how the bytes of one pull move between one pair of peers.

The control conversation (handshake, pull request, heartbeat, ack, abort) always rides the zmq
connection between a ``KVReceiver`` and a ``KVSender``; a transport only moves the KV:

  * sender half (``SenderSide``, on the sender's serving thread): ``serve(job)`` starts moving
    the requested blocks and returns a ``Completion`` that is done once the transport no longer
    reads them (the lease is never released before: the engine may rewrite released blocks);
  * receiver half (``ReceiverSide``, on the receiver's I/O thread): ``on_data`` takes the data
    messages of a pull (zmq chunks, or the ``Ready`` notice of the direct-read transports),
    validates them against the pull's plan BEFORE writing, lands them in the destination
    blocks, and says when every block has landed; ``poll`` covers asynchronous transports.

Transports whose receiver reads the sender's memory directly (shm, loopback) set
``needs_confirm``: the pull is DONE only when the sender confirms the lease was still held when
the receiver acked, so a lease that ended mid-copy can never yield a "successful" stale read.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from cluster.common.faults import FaultPoints
from cluster.config import TransferConfig
from cluster.kv_transfer.framing import Buffer, Inbound
from cluster.kv_transfer.plan import FramePlan
from cluster.kv_transfer.pool import KVPool
from cluster.kv_transfer.protocol import (
    HelloReply,
    KVTransferError,
    KVTransferParams,
    Message,
    PullRequest,
    Ready,
    Reason,
    Segment,
    TransferState,
)
from cluster.kv_transfer.stats import TransferStats


@dataclass(frozen=True, slots=True)
class PeerInfo:
    instance_id: str
    host_id: str
    pid: int


class Completion:
    """Done when a transport has stopped reading a lease's blocks (ok or not)."""

    def __init__(self, trackers: Sequence[zmq.MessageTracker] = (), *, pending: bool = False):
        self._trackers = list(trackers)
        self._event = threading.Event()
        if not pending:
            self._event.set()
        self.ok = True
        self.reason = ""

    def finish(self, ok: bool, reason: str = "") -> None:
        """For asynchronous transports; callable from any thread."""
        self.ok, self.reason = ok, reason
        self._event.set()

    def done(self) -> bool:
        if not self._event.is_set():
            return False
        if self._trackers:
            self._trackers = [t for t in self._trackers if not t.done]
        return not self._trackers


@dataclass
class SenderContext:
    pool: KVPool
    config: TransferConfig
    local: PeerInfo
    # (identity, message, raw frames, track) -> trackers; the serving thread only
    send: Callable[[bytes, Message, Sequence[Buffer], bool], list[zmq.MessageTracker]]
    fault_points: FaultPoints
    stats: TransferStats
    dist_store: Any = None  # torch TCPStore (torch_dist), owned by the sender
    cuda_ipc: str = ""  # the device pool's exported CUDA IPC handle (cuda_ipc), or ""


@dataclass(slots=True)
class ServeJob:
    identity: bytes
    pull: PullRequest
    frames: tuple[tuple[Segment, ...], ...]  # validated: in the lease, in the pool, once each


class SenderSide(ABC):
    @abstractmethod
    def serve(self, job: ServeJob) -> Completion: ...

    def on_setup(self, generation: int) -> None:  # noqa: B027 - optional hook
        """A ``DistSetup`` from the peer (torch_dist only)."""

    def check_pull(self, pull: PullRequest) -> None:  # noqa: B027 - optional hook
        """Raise ``KVTransferError`` if this pair cannot serve the pull now."""

    def abort_pull(self, pull_id: int) -> None:  # noqa: B027 - optional hook
        """The receiver gave up on this pull: stop moving its data soon."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


@dataclass
class ReceiverContext:
    pool: KVPool
    config: TransferConfig
    local: PeerInfo
    stats: TransferStats
    clock: Callable[[], float]  # the receiver's monotonic clock (pull deadlines)


@dataclass(slots=True, eq=False)
class RecvPull:
    """One pull on the receiver side; owned by the I/O thread."""

    pull_id: int
    params: KVTransferParams
    src_ids: tuple[int, ...]  # source pool block ids to fetch
    dst_ids: tuple[int, ...]  # where each lands in this pool (the request's reservation)
    plan: FramePlan
    checksum: bool
    started: float
    deadline: float
    future: Future[Any]
    transport: str = ""
    state: TransferState = TransferState.PENDING
    next_frame: int = 0  # frames landed so far, in plan order
    confirming: bool = False  # data landed, waiting for the sender's AckReply
    final: bool = True  # False: one part of a streamed lease, which stays held after it
    extra: dict[str, Any] = field(default_factory=dict)


class Rejected(KVTransferError):
    """Drop this message (counted by reason); the pull it names goes on."""


def check_ready(pull: RecvPull, inbound: Inbound, transport: str, *, repeated: bool) -> Ready:
    """The ``Ready`` of a transport whose sender sends no raw frames (shm, loopback, cuda_ipc,
    torch_dist): one per pull (``repeated``: one already came), with one checksum per planned
    frame or none. Anything else is dropped (``Rejected``) or fails the pull."""
    msg = inbound.msg
    if not isinstance(msg, Ready) or inbound.frames:
        raise Rejected(Reason.UNEXPECTED, f"{msg.TAG} during a {transport} pull")
    if repeated:
        raise Rejected(Reason.DUPLICATE, "second Ready for one pull")
    if (pull.checksum or msg.crcs) and len(msg.crcs) != len(pull.plan.frames):
        raise KVTransferError(Reason.BAD_FRAMES, "checksums missing or miscounted")
    return msg


def check_sources(plan: FramePlan, num_src: int) -> None:
    """Every planned source block is inside the sender's pool as the receiver mapped it (the
    plan came from the handshake's numbers; the mapping is what a read can touch)."""
    for frame in plan.frames:
        for src, _dst, count in frame:
            if src + count > num_src:
                raise KVTransferError(Reason.BAD_BLOCKS, f"source block {src + count - 1}")


class ReceiverSide(ABC):
    needs_confirm = False

    def control_messages(self) -> list[Message]:
        """Messages to send now: after the handshake and before each pull (``DistSetup``)."""
        return []

    def pull_fields(self) -> dict[str, Any]:
        """Extra ``PullRequest`` fields this transport fills (torch_dist: the generation)."""
        return {}

    @abstractmethod
    def on_data(self, pull: RecvPull, inbound: Inbound) -> bool:
        """Validate, then land; True once every frame of the pull has landed and verified."""

    def poll(self, pull: RecvPull) -> bool:
        """Asynchronous transports: True once landed (``KVTransferError`` if it failed)."""
        return False

    def abort(self, pull: RecvPull) -> Completion:
        """The pull failed: stop moving its data; done once nothing can write its blocks."""
        return Completion()

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


@dataclass(frozen=True)
class TransportSpec:
    name: str
    # Does the sender offer it at all (shm: a shared pool; torch_dist: a rendezvous store)?
    offered: Callable[[SenderContext], bool]
    # Can this pair use it (shm: one host; loopback: one process)?
    pair_ok: Callable[[PeerInfo, HelloReply], bool]
    open_sender: Callable[[SenderContext, PeerInfo], SenderSide]
    open_receiver: Callable[[ReceiverContext, HelloReply], ReceiverSide]
    # The receiver reads the sender's memory itself: DONE needs the sender's AckReply.
    needs_confirm: bool = False
