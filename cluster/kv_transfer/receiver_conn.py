"""The receiver's connection to one sender incarnation (endpoint, instance id, epoch).

Owned by the receiver's I/O thread; it sees the receiver only as a ``ConnectionOwner`` and its
socket as a ``PeerLink``. States: HANDSHAKING -> READY, or FAILED (layout or version mismatch, a
restarted peer, refused auth, no common transport): a failed connection fails its pulls with the
reason and is replaced by a fresh one on the next pull.

A pull's data is validated against its plan before any write into the destination blocks; a
pull that fails stays "failing" until its transport confirms nothing can still write those
blocks (torch_dist), and only then does the caller hear about it and may reuse them.
"""

from __future__ import annotations

from typing import Any, Protocol

import zmq

from cluster.kv_transfer.framing import Inbound, InboundError
from cluster.kv_transfer.handshake import check_reply, open_transport
from cluster.kv_transfer.plan import plan_frames
from cluster.kv_transfer.protocol import (
    MAX_HEARTBEAT_IDS,
    Abort,
    Ack,
    AckReply,
    Chunk,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    KVTransferError,
    KVTransferParams,
    Message,
    PullError,
    PullRequest,
    Ready,
    Reason,
)
from cluster.kv_transfer.protocol import TransferState as State
from cluster.kv_transfer.receiver_link import PeerLink
from cluster.kv_transfer.transports import TRANSPORTS
from cluster.kv_transfer.transports.base import (
    Completion,
    ReceiverContext,
    ReceiverSide,
    RecvPull,
    Rejected,
)

# The sender no longer holds these leases, or never did: no point telling it to free them.
_NO_ABORT_REASONS = (
    Reason.UNKNOWN_TRANSFER,
    Reason.STALE_TRANSFER,
    Reason.STALE_EPOCH,
    Reason.NO_HANDSHAKE,
)


class ConnectionOwner(Protocol):
    """The receiver, as its connections see it (every call on the receiver's I/O thread)."""

    rctx: ReceiverContext  # pool, config, our identity, stats, clock

    def open_link(self, endpoint: str) -> PeerLink: ...  # a new socket, with its own routing id
    def watch(self, conn: PeerConnection) -> None: ...  # poll conn.link (again for a new one)
    def unwatch(self, conn: PeerConnection) -> None: ...
    def finish_ok(self, pull: RecvPull) -> None: ...  # every block landed and verified
    # The pull failed, and nothing can still write its destination blocks:
    def finish_failed(self, pull: RecvPull, reason: str, message: str) -> None: ...
    # The sender no longer holds the lease: a later pull of it fails at once:
    def mark_lost(self, transfer_id: str, reason: str, message: str) -> None: ...


class PeerConnection:
    HANDSHAKING, READY, FAILED = "handshaking", "ready", "failed"

    def __init__(self, owner: ConnectionOwner, params: KVTransferParams) -> None:
        self.owner = owner
        self.ctx = owner.rctx
        self.key = params.peer_key
        cfg = self.ctx.config
        use_ipc = cfg.ipc and params.ipc_endpoint and params.host_id == self.ctx.local.host_id
        self.endpoint = params.ipc_endpoint if use_ipc else params.endpoint
        self.pulls: dict[int, RecvPull] = {}  # in flight (sent), by pull id
        self.waiting: list[RecvPull] = []  # admitted before the handshake finished
        self.outbox: list[Message] = []  # control messages held until the handshake
        self.holds: dict[str, KVTransferParams] = {}  # leases to heartbeat, by transfer id
        self.failing: list[tuple[RecvPull, Completion, str, str]] = []
        self.last_active = self.ctx.clock()
        self._open()

    def _open(self) -> None:
        """A fresh link and handshake (at start, and after the connection dropped)."""
        cfg, local = self.ctx.config, self.ctx.local
        self.link = self.owner.open_link(self.endpoint)
        self.state = self.HANDSHAKING
        self.reply: HelloReply | None = None
        self.side: ReceiverSide | None = None
        self.transport = ""
        self.next_heartbeat = self.ctx.clock() + cfg.heartbeat_s
        self.owner.watch(self)
        self.link.send(
            Hello(
                local.instance_id,
                local.host_id,
                local.pid,
                self.ctx.pool.layout,
                tuple(cfg.transports),
            )
        )

    def _reopen(self) -> None:
        """The connection dropped (peer died, or zmq cut it for an oversized frame, which it
        never redials): fail what was in flight, keep the holds, start over on a new socket."""
        self.state = self.HANDSHAKING  # the aborts below wait for the new handshake
        for pull in list(self.pulls.values()):
            self.fail_pull(
                pull,
                Reason.PEER_DISCONNECTED,
                "connection dropped mid-transfer (sender died, or a frame exceeded "
                "transfer.max_message_bytes)",
            )
        self.outbox = [*self.link.backlog, *self.outbox]  # these go out after the new handshake
        self.link.backlog = []
        self.owner.unwatch(self)
        self._close_link()
        self.ctx.stats.inc("reconnects")
        self._open()

    @property
    def busy(self) -> bool:
        return bool(self.pulls or self.waiting or self.holds or self.failing)

    # -- requests from the receiver (I/O thread) ----------------------------------------------

    def add_pull(self, pull: RecvPull) -> None:
        self.last_active = self.ctx.clock()
        if self.state == self.READY:
            self._start_pull(pull)
        else:
            self.waiting.append(pull)

    def abort(self, transfer_id: str, reason: str) -> None:
        self.holds.pop(transfer_id, None)
        for pull in [*self.pulls.values(), *self.waiting]:
            if pull.params.transfer_id == transfer_id:
                self.fail_pull(pull, Reason.ABORTED, f"aborted here ({reason})")
                return
        self.send(Abort(transfer_id, 0, reason))

    def send(self, msg: Message) -> None:
        if self.state == self.READY:
            self.link.send(msg)
        else:
            self.outbox.append(msg)

    # -- inbound ------------------------------------------------------------------------------

    def on_readable(self) -> None:
        for _ in range(256):
            try:
                batch = self.link.recv()
            except zmq.Again:
                return
            except KVTransferError as e:
                self._refused(e)
                continue
            for inbound in batch:
                self._handle(inbound)

    def _refused(self, e: KVTransferError) -> None:
        """A message the framing refused: counted; some also end the handshake or a pull."""
        self.ctx.stats.rejected(e.reason)
        if self.state == self.HANDSHAKING and e.reason == Reason.BAD_VERSION:
            self.fail(e.reason, f"the sender speaks another protocol ({e.detail})")
        elif self.state == self.HANDSHAKING and e.reason == Reason.LAYOUT_MISMATCH:
            self.fail(e.reason, f"KV layout differs: {e.detail}")
        elif isinstance(e, InboundError) and isinstance(e.msg, Chunk | Ready):
            # An authentic header whose KV frames were altered: fail its pull now, nothing
            # written (a forged header is only counted: it names nothing we can trust).
            pull = self.pulls.get(e.msg.pull_id)
            if pull is not None and pull.state is State.TRANSFERRING:
                self.fail_pull(pull, e.reason, e.detail)

    def on_monitor(self) -> None:
        for kind in self.link.monitor_events():
            if kind == zmq.EVENT_DISCONNECTED:
                self._reopen()
                return  # the old monitor is closed
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.fail(Reason.BAD_AUTH, "the sender refused our CURVE key")
            else:  # e.g. a peer dying mid-handshake, or wrong keys: zmq retries, pulls time out
                self.ctx.stats.inc("handshake_failures")

    def _handle(self, inbound: Inbound) -> None:
        msg = inbound.msg
        self.last_active = self.ctx.clock()
        if isinstance(msg, HelloReply):
            self._on_hello_reply(msg)
        elif self.state != self.READY:
            self.ctx.stats.rejected(Reason.UNEXPECTED)
        elif isinstance(msg, Chunk | Ready):
            self._on_data(inbound, msg.pull_id)
        elif isinstance(msg, PullError):
            self._on_pull_error(msg)
        elif isinstance(msg, AckReply):
            self._on_ack_reply(msg)
        elif isinstance(msg, HeartbeatReply):
            for tid in msg.unknown:
                if self.holds.pop(tid, None) is not None:
                    self.owner.mark_lost(tid, Reason.LEASE_EXPIRED, "the sender no longer holds it")
        else:
            self.ctx.stats.rejected(Reason.UNEXPECTED)

    def _on_pull_error(self, msg: PullError) -> None:
        pull = self.pulls.get(msg.pull_id)
        if pull is None or pull.params.transfer_id != msg.transfer_id:
            self.ctx.stats.rejected(Reason.UNEXPECTED)
            return
        notify = msg.reason not in _NO_ABORT_REASONS
        self.fail_pull(pull, msg.reason, f"refused by the sender: {msg.message}", notify)

    def _on_ack_reply(self, msg: AckReply) -> None:
        pull = self.pulls.get(msg.pull_id)
        if pull is None or not pull.confirming:
            self.ctx.stats.rejected(Reason.UNEXPECTED)
        elif msg.ok:
            self._complete(pull)
        else:
            reason = Reason.LEASE_EXPIRED
            self.fail_pull(pull, reason, "the lease ended before the ack", notify=False)

    def _on_hello_reply(self, msg: HelloReply) -> None:
        if self.state != self.HANDSHAKING:
            self.ctx.stats.rejected(Reason.UNEXPECTED)
            return
        try:
            check_reply(msg, self.key, self.endpoint, self.ctx.pool.layout)
            self.transport, self.side = open_transport(self.ctx, msg)
        except KVTransferError as e:
            self.fail(e.reason, e.detail)
            return
        self.reply = msg
        self.state = self.READY
        self.ctx.stats.inc(f"connections_{self.transport}")
        for m in self.side.control_messages() + self.outbox:
            self.link.send(m)
        self.outbox = []
        waiting, self.waiting = self.waiting, []
        for pull in waiting:
            self._start_pull(pull)

    # -- pulls --------------------------------------------------------------------------------

    def _start_pull(self, pull: RecvPull) -> None:
        assert self.side is not None and self.reply is not None
        self.pulls[pull.pull_id] = pull
        if max(pull.src_ids) >= self.reply.num_blocks:
            self.fail_pull(pull, Reason.BAD_BLOCKS, "source block ids outside the sender pool")
            return
        if self.reply.max_frame_bytes < self.ctx.config.max_frame_bytes:
            # The sender takes smaller frames than admission planned with: plan again.
            bpb = self.ctx.pool.bytes_per_block
            limit = self.reply.max_frame_bytes
            pull.plan = plan_frames(pull.src_ids, pull.dst_ids, bpb, limit)
        for m in self.side.control_messages():
            self.link.send(m)
        self.holds.pop(pull.params.transfer_id, None)  # the pull itself keeps the lease now
        p = pull.params
        fields: dict[str, Any] = {"dist_generation": 0, **self.side.pull_fields()}
        request = PullRequest(
            pull_id=pull.pull_id,
            transfer_id=p.transfer_id,
            request_id=p.request_id,
            epoch=p.epoch,
            transport=self.transport,
            frames=pull.plan.wire_frames(),
            checksum=pull.checksum,
            final=pull.final,
            **fields,
        )
        pull.transport = self.transport
        pull.state = State.TRANSFERRING
        self.link.send(request)

    def _on_data(self, inbound: Inbound, pull_id: int) -> None:
        pull = self.pulls.get(pull_id)
        if pull is None or pull.state is not State.TRANSFERRING or pull.confirming:
            self.ctx.stats.rejected(Reason.UNEXPECTED)  # e.g. late frames of a failed pull
            return
        assert self.side is not None
        try:
            landed = self.side.on_data(pull, inbound)
        except Rejected as e:
            self.ctx.stats.rejected(e.reason)
            return
        except KVTransferError as e:
            self.ctx.stats.rejected(e.reason)
            self.fail_pull(pull, e.reason, e.detail)
            return
        if landed:
            self._landed(pull)

    def _landed(self, pull: RecvPull) -> None:
        ack = Ack(pull.pull_id, pull.params.transfer_id)
        if TRANSPORTS[self.transport].needs_confirm:
            self.link.send(ack)
            pull.confirming = True
        else:
            # Done here: the caller hears first, then the sender (whose release of the lease
            # and of its sent frames would otherwise compete with the caller for the cores).
            self._complete(pull)
            self.link.send(ack)

    def _complete(self, pull: RecvPull) -> None:
        del self.pulls[pull.pull_id]
        pull.state = State.DONE
        if not pull.final:  # a part of a streamed lease: heartbeat it until the next part
            self.holds[pull.params.transfer_id] = pull.params
        self.owner.finish_ok(pull)

    def fail_pull(self, pull: RecvPull, reason: str, message: str, notify: bool = True) -> None:
        if pull.state in (State.DONE, State.FAILED):
            return
        pull.state = State.FAILED
        self.pulls.pop(pull.pull_id, None)
        if pull in self.waiting:
            self.waiting.remove(pull)
        done = self.side.abort(pull) if self.side is not None else Completion()
        if notify:
            self.send(Abort(pull.params.transfer_id, pull.pull_id, reason))
        self.failing.append((pull, done, reason, message))

    def fail(self, reason: str, message: str) -> None:
        """The whole connection is unusable: fail everything on it."""
        self.state = self.FAILED
        for pull in [*self.pulls.values(), *self.waiting]:
            self.fail_pull(pull, reason, message, notify=False)
        for tid in self.holds:
            self.owner.mark_lost(tid, reason, message)
        self.holds.clear()

    # -- time ---------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self.link.flush()
        timeout = self.ctx.config.transfer_timeout_s
        for pull in [*self.pulls.values(), *self.waiting]:
            if now >= pull.deadline:
                self.fail_pull(pull, Reason.TIMEOUT, f"no complete transfer within {timeout} s")
            elif pull.state is State.TRANSFERRING and self.side is not None:
                try:
                    landed = self.side.poll(pull)
                except KVTransferError as e:
                    self.fail_pull(pull, e.reason, e.detail)
                    continue
                if landed:
                    self._landed(pull)
        still = []
        for pull, done, reason, message in self.failing:
            if done.done():
                self.owner.finish_failed(pull, reason, message)
            else:
                still.append((pull, done, reason, message))
        self.failing = still
        if self.state == self.READY and self.holds and now >= self.next_heartbeat:
            self.next_heartbeat = now + self.ctx.config.heartbeat_s
            ids = list(self.holds)
            for i in range(0, len(ids), MAX_HEARTBEAT_IDS):
                self.link.send(Heartbeat(tuple(ids[i : i + MAX_HEARTBEAT_IDS])))
            self.ctx.stats.inc("heartbeats_sent")

    def close(self) -> None:
        self.owner.unwatch(self)
        self._close_link()

    def _close_link(self) -> None:
        if self.side is not None:
            self.side.close()
            self.side = None
        self.link.close()
