"""The sender's side of the conversation: one handler per message, on the serving thread.

Every request is validated before it touches a lease or the pool; a refusal is counted by reason
(``rejected``) and, where the peer waits for an answer, answered with the reason. Nothing a peer
sends can end the serving thread. The handlers see the sender only as a ``LeaseKeeper``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from cluster.kv_transfer.framing import Inbound
from cluster.kv_transfer.leases import Lease, LeaseState
from cluster.kv_transfer.plan import check_source_frames
from cluster.kv_transfer.protocol import (
    Abort,
    Ack,
    AckReply,
    DistSetup,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    KVTransferError,
    Message,
    PullError,
    PullRequest,
    Reason,
)
from cluster.kv_transfer.transports import TRANSPORTS
from cluster.kv_transfer.transports.base import (
    Completion,
    PeerInfo,
    SenderContext,
    SenderSide,
    ServeJob,
)

logger = logging.getLogger(__name__)
_MAX_PEERS = 1024


@dataclass
class _Peer:
    info: PeerInfo
    sides: dict[str, SenderSide] = field(default_factory=dict)
    transports: dict[str, str] = field(default_factory=dict)  # transfer_id -> transport used


class LeaseKeeper(Protocol):
    """The sender's leases, as the handlers see them (every call on the serving thread)."""

    def lease_for(self, transfer_id: str) -> Lease | None: ...
    def lease_is_finished(self, transfer_id: str) -> bool: ...  # released: a replay, not unknown
    def renew(self, transfer_id: str) -> bool: ...  # False if the lease is gone or ending
    def track(self, transfer_id: str, done: Completion) -> None: ...  # read until ``done``
    def is_serving(self, transfer_id: str) -> bool: ...  # a tracked read not seen done yet
    def end_lease(self, lease: Lease, reason: str) -> None: ...  # now, or once reads finish


class SenderHandlers:
    def __init__(self, ctx: SenderContext, leases: LeaseKeeper, *, epoch: int) -> None:
        self.ctx = ctx
        self.leases = leases
        self.epoch = epoch
        self.stats = ctx.stats
        self.peers: OrderedDict[bytes, _Peer] = OrderedDict()  # routing id -> handshaken peer

    def handle(self, inbound: Inbound) -> None:
        msg = inbound.msg
        if isinstance(msg, Hello):
            self._hello(inbound.identity, msg)
            return
        peer = self.peers.get(inbound.identity)
        if peer is None:
            self.stats.rejected(Reason.NO_HANDSHAKE)
            if isinstance(msg, PullRequest):
                self._refuse(inbound.identity, msg, Reason.NO_HANDSHAKE, "handshake first")
            return
        self.peers.move_to_end(inbound.identity)
        if isinstance(msg, PullRequest):
            self._pull(inbound.identity, peer, msg)
        elif isinstance(msg, Heartbeat):
            self._heartbeat(inbound.identity, msg)
        elif isinstance(msg, Ack):
            self._ack(inbound.identity, peer, msg)
        elif isinstance(msg, Abort):
            self._abort(inbound.identity, peer, msg)
        elif isinstance(msg, DistSetup):
            try:
                self._side(peer, "torch_dist").on_setup(msg.generation)
            except KVTransferError as e:
                self.stats.rejected(e.reason)
        else:
            self.stats.rejected(Reason.UNEXPECTED)

    # -- handshake ----------------------------------------------------------------------------

    def _hello(self, identity: bytes, msg: Hello) -> None:
        mismatch = self.ctx.pool.layout.mismatch(msg.layout)
        if mismatch is not None:
            self.stats.rejected(Reason.LAYOUT_MISMATCH)
            self._send(identity, self._hello_reply(False, Reason.LAYOUT_MISMATCH, mismatch))
            return
        if len(self.peers) >= _MAX_PEERS and identity not in self.peers:
            _, old = self.peers.popitem(last=False)
            for side in old.sides.values():
                side.close()
        self.peers[identity] = _Peer(PeerInfo(msg.instance_id, msg.host_id, msg.pid))
        self.stats.inc("handshakes")
        self._send(identity, self._hello_reply(True, "", ""))

    def refuse_handshake(self, identity: bytes, reason: str, detail: str) -> None:
        """Answer a message we cannot read (another protocol version, a layout we do not know)
        in ours: the peer fails its handshake at once."""
        if identity:
            self._send(identity, self._hello_reply(False, reason, detail))

    def _hello_reply(self, ok: bool, reason: str, message: str) -> HelloReply:
        ctx = self.ctx
        offered = tuple(n for n in ctx.config.transports if TRANSPORTS[n].offered(ctx))
        store = ctx.dist_store
        return HelloReply(
            ok=ok,
            reason=reason,
            message=message,
            instance_id=ctx.local.instance_id,
            epoch=self.epoch,
            host_id=ctx.local.host_id,
            pid=ctx.local.pid,
            layout=ctx.pool.layout,
            transports=offered,
            num_blocks=ctx.pool.num_blocks,
            shm_name=ctx.pool.shm_path,
            dist_store=store.address if store is not None else "",
            max_frame_bytes=ctx.config.max_frame_bytes,
            cuda_ipc=ctx.cuda_ipc,
        )

    # -- pulls --------------------------------------------------------------------------------

    def _pull(self, identity: bytes, peer: _Peer, msg: PullRequest) -> None:
        lease = self.leases.lease_for(msg.transfer_id)
        if lease is not None and (lease.peer, lease.pull_id) == (identity, msg.pull_id):
            # A replay of the pull being served (K5): drop it without an answer, which the
            # receiver would take as the failure of its pull.
            self.stats.rejected(Reason.DUPLICATE)
            return
        try:
            lease, blocks = self._check_pull(msg, lease)
            side = self._side(peer, msg.transport)
            side.check_pull(msg)
        except KVTransferError as e:
            self.stats.rejected(e.reason)
            self._refuse(identity, msg, e.reason, e.detail)
            return
        lease.state, lease.pull_id, lease.peer = LeaseState.SENDING, msg.pull_id, identity
        lease.final_pull = msg.final
        self.leases.renew(lease.transfer_id)
        peer.transports[lease.transfer_id] = msg.transport
        job = ServeJob(identity, msg, msg.frames)
        t0 = time.perf_counter()
        try:
            done = side.serve(job)
        except zmq.ZMQError as e:  # e.g. the peer vanished (ROUTER_MANDATORY)
            lease.state = LeaseState.SENT
            self.stats.failed(Reason.PEER_DISCONNECTED)
            logger.info("kv-sender: pull %s: %s", lease.request_id, e)
            return
        self.leases.track(lease.transfer_id, done)
        self.stats.observe("serve_time_s", time.perf_counter() - t0)  # to queue every frame
        lease.sent |= blocks
        self.stats.inc("pulls_served")
        self.stats.inc("blocks_sent", len(blocks))
        self.stats.inc("bytes_sent", len(blocks) * self.ctx.pool.bytes_per_block)

    def _check_pull(self, msg: PullRequest, lease: Lease | None) -> tuple[Lease, set[int]]:
        """The lease ``msg`` pulls from (``lease``: the one its transfer id names, or None)
        and the blocks it asks for, or ``KVTransferError`` with the reason to answer."""
        if msg.epoch != self.epoch:
            raise KVTransferError(Reason.STALE_EPOCH, f"epoch {msg.epoch}, this is {self.epoch}")
        if msg.transport not in TRANSPORTS or not TRANSPORTS[msg.transport].offered(self.ctx):
            raise KVTransferError(Reason.NO_TRANSPORT, f"{msg.transport!r} is not offered")
        if lease is None or lease.request_id != msg.request_id:
            if self.leases.lease_is_finished(msg.transfer_id):
                raise KVTransferError(Reason.STALE_TRANSFER, "this transfer already ended")
            raise KVTransferError(Reason.UNKNOWN_TRANSFER, "no such lease (expired or never)")
        if lease.state is not LeaseState.LEASED:
            raise KVTransferError(Reason.DUPLICATE, f"lease is {lease.state.value}")
        if msg.final and lease.open:
            raise KVTransferError(
                Reason.STREAM_OPEN, "the lease still grows (its prefill runs): pull a part"
            )
        pool = self.ctx.pool
        blocks = check_source_frames(
            msg.frames,
            frozenset(lease.block_ids),
            pool.num_blocks,
            pool.bytes_per_block,
            self.ctx.config.max_message_bytes,
        )
        again = sorted(blocks & lease.sent)
        if again:
            raise KVTransferError(Reason.DUPLICATE, f"blocks {again[:8]} were pulled already")
        return lease, blocks

    def _refuse(self, identity: bytes, msg: PullRequest, reason: str, message: str) -> None:
        self._send(identity, PullError(msg.pull_id, msg.transfer_id, reason, message[:500]))

    # -- lease messages -----------------------------------------------------------------------

    def _heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        unknown = tuple(tid for tid in msg.transfer_ids if not self.leases.renew(tid))
        self.stats.inc("heartbeats_received")
        self._send(identity, HeartbeatReply(unknown))

    def _ack(self, identity: bytes, peer: _Peer, msg: Ack) -> None:
        lease = self.leases.lease_for(msg.transfer_id)
        transport = peer.transports.pop(msg.transfer_id, "")
        valid = (
            lease is not None
            and lease.peer == identity
            and lease.pull_id == msg.pull_id
            and lease.state in (LeaseState.SENDING, LeaseState.SENT)
        )
        if not valid:
            self.stats.rejected(Reason.STALE_ACK)
            self._send(identity, AckReply(msg.pull_id, False, Reason.STALE_ACK))
            return
        assert lease is not None
        if transport and TRANSPORTS[transport].needs_confirm:  # the receiver waits for this
            self._send(identity, AckReply(msg.pull_id, True, ""))
        if not lease.final_pull:  # one part of a streamed lease: it stays for the rest
            lease.state = LeaseState.LEASED
            self.leases.renew(lease.transfer_id)
            self.stats.inc("parts_acked")
            return
        self.leases.end_lease(lease, "acked")

    def _abort(self, identity: bytes, peer: _Peer, msg: Abort) -> None:
        lease = self.leases.lease_for(msg.transfer_id)
        if lease is None:
            self.stats.rejected(Reason.UNKNOWN_TRANSFER)
            return
        transport = peer.transports.pop(msg.transfer_id, "")
        side = peer.sides.get(transport)
        if side is not None and self.leases.is_serving(msg.transfer_id):
            side.abort_pull(msg.pull_id)
        self.leases.end_lease(lease, "peer_aborted")

    # -- helpers ------------------------------------------------------------------------------

    def _side(self, peer: _Peer, name: str) -> SenderSide:
        side = peer.sides.get(name)
        if side is None:
            if name not in TRANSPORTS or not TRANSPORTS[name].offered(self.ctx):
                raise KVTransferError(Reason.NO_TRANSPORT, f"{name!r} is not offered")
            side = TRANSPORTS[name].open_sender(self.ctx, peer.info)
            peer.sides[name] = side
        return side

    def _send(self, identity: bytes, msg: Message) -> None:
        try:
            self.ctx.send(identity, msg, [], False)
        except zmq.ZMQError as e:  # the peer is gone; nothing to answer
            logger.debug("kv-sender: cannot answer %s: %s", msg.TAG, e)

    def close(self) -> None:
        for peer in self.peers.values():
            for side in peer.sides.values():
                side.close()
        self.peers.clear()
