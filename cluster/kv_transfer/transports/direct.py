"""``shm`` and ``loopback``: the receiver copies straight out of the sender's pool.

One copy, pool to pool, and no KV byte on a socket: the sender answers a pull with ``Ready``
(the blocks are leased, so the engine does not write them), the receiver copies its planned
segments from the source pool into its destination blocks, acks, and reports DONE only once
the sender confirms the lease was still held at the ack (``needs_confirm``).

  * ``shm``: the sender's pool lives in a memfd (``KVPool.allocate(shared=True)``); a receiver
    on the same host maps it read-only through ``/proc/<pid>/fd/<n>``: only that path, with the
    sender's pid, naming a pdserve pool memfd of the expected size, opened without blocking
    (``pool.MappedPool``); any other name fails the transport (``no_transport``), so the pair
    falls back to the next one.
  * ``loopback``: sender and receiver in one process (tests); the source pool is found in an
    in-process registry by the sender's instance id.
"""

from __future__ import annotations

import weakref

import numpy as np

from cluster.kv_transfer.framing import Inbound
from cluster.kv_transfer.plan import crc_segments
from cluster.kv_transfer.pool import KVPool, MappedPool
from cluster.kv_transfer.protocol import HelloReply, KVTransferError, Ready, Reason
from cluster.kv_transfer.transports.base import (
    Completion,
    PeerInfo,
    ReceiverContext,
    ReceiverSide,
    RecvPull,
    SenderContext,
    SenderSide,
    ServeJob,
    TransportSpec,
    check_ready,
    check_sources,
)

# Sender instance id -> its pool, for in-process pulls. Weak: the registry never keeps a pool
# alive; loopback is by definition a rendezvous inside one process.
LOCAL_POOLS: weakref.WeakValueDictionary[str, KVPool] = weakref.WeakValueDictionary()


class ReadySender(SenderSide):
    def __init__(self, ctx: SenderContext, peer: PeerInfo) -> None:
        self.ctx = ctx

    def serve(self, job: ServeJob) -> Completion:
        pool = self.ctx.pool
        crcs: tuple[int, ...] = ()
        if job.pull.checksum:
            crcs = tuple(
                crc_segments([pool.byte_view(s, n) for s, n in frame]) for frame in job.frames
            )
        self.ctx.send(job.identity, Ready(job.pull.pull_id, crcs), [], False)
        return Completion()  # the reader is the receiver; the ack confirmation guards it


class DirectReadReceiver(ReceiverSide):
    needs_confirm = True

    def __init__(
        self, ctx: ReceiverContext, source: np.ndarray, mapped: MappedPool | None = None
    ) -> None:
        self.pool = ctx.pool
        self.source = source  # [num_src_blocks, bytes_per_block] uint8, read-only
        self.mapped = mapped

    def on_data(self, pull: RecvPull, inbound: Inbound) -> bool:
        msg = check_ready(pull, inbound, "direct-read", repeated=pull.next_frame > 0)
        plan = pull.plan
        check_sources(plan, self.source.shape[0])
        for i, frame in enumerate(plan.frames):
            for src, dst, count in frame:
                np.copyto(self.pool.byte_view(dst, count), self.source[src : src + count])
            if msg.crcs:
                got = crc_segments([self.pool.byte_view(d, n) for _, d, n in frame])
                if got != msg.crcs[i]:
                    raise KVTransferError(Reason.CHECKSUM, f"frame {i}")
        pull.next_frame = len(plan.frames)
        return True

    def close(self) -> None:
        self.source = np.empty((0, 0), dtype=np.uint8)
        if self.mapped is not None:
            self.mapped.close()


def _open_shm(ctx: ReceiverContext, reply: HelloReply) -> ReceiverSide:
    try:
        mapped = MappedPool(reply.shm_name, reply.num_blocks, ctx.pool.bytes_per_block, reply.pid)
    except (OSError, ValueError) as e:
        raise KVTransferError(Reason.NO_TRANSPORT, f"shm: cannot map the sender pool: {e}") from e
    assert mapped.bytes is not None
    return DirectReadReceiver(ctx, mapped.bytes, mapped)


def _open_loopback(ctx: ReceiverContext, reply: HelloReply) -> ReceiverSide:
    pool = LOCAL_POOLS.get(reply.instance_id)
    if pool is None or pool.bytes is None:
        raise KVTransferError(Reason.NO_TRANSPORT, "loopback: sender pool not in this process")
    return DirectReadReceiver(ctx, pool.bytes)


def _same_host(local: PeerInfo, reply: HelloReply) -> bool:
    return local.host_id == reply.host_id


SHM = TransportSpec(
    name="shm",
    offered=lambda ctx: bool(ctx.pool.shm_path),
    pair_ok=lambda local, reply: _same_host(local, reply) and bool(reply.shm_name),
    open_sender=ReadySender,
    open_receiver=_open_shm,
    needs_confirm=True,
)

LOOPBACK = TransportSpec(
    name="loopback",
    offered=lambda ctx: ctx.pool.bytes is not None,
    pair_ok=lambda local, reply: _same_host(local, reply) and local.pid == reply.pid,
    open_sender=ReadySender,
    open_receiver=_open_loopback,
    needs_confirm=True,
)
