"""``torch_dist``: torch.distributed point-to-point send/recv (NCCL on GPUs, gloo on CPU).

No global process group: each (sender, receiver) pair gets its own 2-rank group, built on demand
through the sender's rendezvous ``TCPStore`` under the prefix ``<namespace><receiver>/<gen>/``
(with auth on, the namespace is derived from the secret and every value is MAC'd:
``rendezvous.SealedStore``).
A pair's blocking collectives run in order on the pair's own thread, never on the serving or
I/O thread. The pull's control still rides zmq: the sender answers ``Ready`` and posts one
``send`` per planned frame; the receiver posts the matching ``recv`` straight into its
destination blocks (the header was validated first; a failed pull never reports DONE).

Failure (reliability matrix F21): a peer that never receives leaves the sender's ``send`` pending;
the receiver's pull times out on the control plane, the receiver aborts its side of the pair
and tells the sender (``Abort``), which aborts its side; every wait carries a timeout, so no
thread waits past it. The next pull builds generation + 1 (``DistSetup``) and succeeds.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from cluster.config import TransferConfig, advertise_host
from cluster.kv_transfer.framing import Inbound
from cluster.kv_transfer.plan import crc_segments
from cluster.kv_transfer.protocol import (
    DistSetup,
    HelloReply,
    KVTransferError,
    Message,
    Ready,
    Reason,
)
from cluster.kv_transfer.security import StoreSealer, rendezvous_secret
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
)
from cluster.kv_transfer.transports.dist_pair import DistPair


def _tag(pull_id: int) -> int:
    return pull_id & 0x3FFFFFFF


def _host(config: TransferConfig) -> str:
    return advertise_host(config)


class DistSender(SenderSide):
    def __init__(self, ctx: SenderContext, peer: PeerInfo) -> None:
        self.ctx = ctx
        self.peer = peer
        self.sealer = StoreSealer(rendezvous_secret(ctx.config))
        self.generation = 0
        self.pair: DistPair | None = None

    def on_setup(self, generation: int) -> None:
        if self.pair is not None:
            self.pair.abort("superseded by a new generation")
        self.generation = generation
        store = self.ctx.dist_store.store
        self.pair = DistPair(
            lambda: store,
            rank=0,
            prefix=f"{self.sealer.namespace}{self.peer.instance_id}/{generation}/",
            timeout_s=self.ctx.config.transfer_timeout_s,
            host=_host(self.ctx.config),
            device=self.ctx.pool.tensor.device,
            sealer=self.sealer,
        )

    def check_pull(self, pull: Any) -> None:
        if self.pair is None or pull.dist_generation != self.generation or self.pair.failed:
            raise KVTransferError(
                Reason.TRANSPORT_ERROR, f"no live pair of generation {pull.dist_generation}"
            )

    def serve(self, job: ServeJob) -> Completion:
        assert self.pair is not None
        pool, pull = self.ctx.pool, job.pull
        tensors = []
        for frame in job.frames:
            views = [pool.block_tensor(s, n) for s, n in frame]
            tensors.append(views[0] if len(views) == 1 else torch.cat(views))
        crcs: tuple[int, ...] = ()
        if pull.checksum:
            crcs = tuple(
                crc_segments([pool.byte_view(s, n) for s, n in frame]) for frame in job.frames
            )
        self.ctx.send(job.identity, Ready(pull.pull_id, crcs), [], False)
        deadline = time.monotonic() + self.ctx.config.transfer_timeout_s
        pair = self.pair

        def send_all(pg: Any) -> None:
            for t in tensors:
                pair.wait(pg.send([t], 1, _tag(pull.pull_id)), deadline)

        return pair.submit(send_all)

    def abort_pull(self, pull_id: int) -> None:
        if self.pair is not None:
            self.pair.abort(f"pull {pull_id} aborted by the receiver")

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close("sender closed")
        self.pair = None


class DistReceiver(ReceiverSide):
    def __init__(self, ctx: ReceiverContext, reply: HelloReply) -> None:
        self.ctx = ctx
        host, _, port = reply.dist_store.rpartition(":")
        self._store_addr = (host, int(port))
        self._store: Any = None
        self.sealer = StoreSealer(rendezvous_secret(ctx.config))
        self.generation = 0
        self.pair: DistPair | None = None
        self._pending: list[Message] = []
        self._new_pair()

    def _store_client(self) -> Any:
        if self._store is None:
            self._store = dist.TCPStore(
                self._store_addr[0],
                self._store_addr[1],
                None,
                False,
                timeout=datetime.timedelta(seconds=self.ctx.config.transfer_timeout_s),
            )
        return self._store

    def _new_pair(self) -> None:
        self.generation += 1
        self.pair = DistPair(
            self._store_client,
            rank=1,
            prefix=f"{self.sealer.namespace}{self.ctx.local.instance_id}/{self.generation}/",
            timeout_s=self.ctx.config.transfer_timeout_s,
            host=_host(self.ctx.config),
            device=self.ctx.pool.tensor.device,
            sealer=self.sealer,
        )
        self._pending.append(DistSetup(self.generation))

    def control_messages(self) -> list[Message]:
        if self.pair is not None and self.pair.failed:
            self._new_pair()  # rebuild after a failure (F21)
        out, self._pending = self._pending, []
        return out

    def pull_fields(self) -> dict[str, Any]:
        return {"dist_generation": self.generation}

    def on_data(self, pull: RecvPull, inbound: Inbound) -> bool:
        msg = check_ready(pull, inbound, "torch_dist", repeated="dist_done" in pull.extra)
        plan = pull.plan
        pool, pair = self.ctx.pool, self.pair
        assert pair is not None
        # The pull's deadline is on the receiver's (injectable) clock; waits use the real one.
        deadline = time.monotonic() + max(0.0, pull.deadline - self.ctx.clock())

        def recv_all(pg: Any) -> None:
            for frame in plan.frames:
                if len(frame) == 1:  # straight into the destination blocks
                    _, dst, count = frame[0]
                    work = pg.recv([pool.block_tensor(dst, count)], 0, _tag(pull.pull_id))
                    pair.wait(work, deadline)
                    continue
                total = sum(n for _, _, n in frame)
                tmp = torch.empty_like(pool.block_tensor(0, total))
                pair.wait(pg.recv([tmp], 0, _tag(pull.pull_id)), deadline)
                offset = 0
                for _, dst, count in frame:
                    pool.block_tensor(dst, count).copy_(tmp[offset : offset + count])
                    offset += count

        pull.extra["dist_crcs"] = msg.crcs
        pull.extra["dist_done"] = pair.submit(recv_all)
        return False

    def poll(self, pull: RecvPull) -> bool:
        done: Completion | None = pull.extra.get("dist_done")
        if done is None or not done.done():
            return False
        if not done.ok:
            raise KVTransferError(Reason.TRANSPORT_ERROR, done.reason)
        crcs = pull.extra["dist_crcs"]
        for i, frame in enumerate(pull.plan.frames if crcs else ()):
            got = crc_segments([self.ctx.pool.byte_view(d, n) for _, d, n in frame])
            if got != crcs[i]:
                raise KVTransferError(Reason.CHECKSUM, f"frame {i}")
        return True

    def abort(self, pull: RecvPull) -> Completion:
        done: Completion | None = pull.extra.get("dist_done")
        if self.pair is not None:
            self.pair.abort("pull aborted")
        return done if done is not None else Completion()

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close("receiver closed")
        self.pair = None
        self._store = None


TORCH_DIST = TransportSpec(
    name="torch_dist",
    offered=lambda ctx: ctx.dist_store is not None,
    pair_ok=lambda local, reply: bool(reply.dist_store),
    open_sender=DistSender,
    open_receiver=DistReceiver,
)
