"""``zmq``: KV frames on the control connection itself (tcp across hosts, ipc on one host).

Per planned frame the sender sends ``Chunk`` + one raw frame, zero-copy from its pool (pyzmq
copies nothing above 64 KiB; the lease stays held until zmq reports every frame handed off).
The receiver validates each chunk against its plan (order, count, byte lengths, crc32) before
the one copy of the frame into the destination blocks, while later frames are still arriving.
"""

from __future__ import annotations

import zlib

import numpy as np

from cluster.kv_transfer.framing import Inbound
from cluster.kv_transfer.plan import crc_segments
from cluster.kv_transfer.protocol import Chunk, HelloReply, KVTransferError, Reason
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
)

FAULT_MID_SEND = "p.mid_send_frame_k"


class Rejected(KVTransferError):
    """Drop this message (counted by reason); the pull it names goes on."""


class ZmqSender(SenderSide):
    def __init__(self, ctx: SenderContext, peer: PeerInfo) -> None:
        self.ctx = ctx

    def serve(self, job: ServeJob) -> Completion:
        pool, pull = self.ctx.pool, job.pull
        trackers = []
        for i, frame in enumerate(job.frames):
            self.ctx.fault_points.hit(FAULT_MID_SEND)
            views = [pool.byte_view(start, count).reshape(-1) for start, count in frame]
            data = views[0] if len(views) == 1 else np.concatenate(views)  # small blocks only
            crcs = (crc_segments(views),) if pull.checksum else ()
            chunk = Chunk(pull.pull_id, i, (data.nbytes,), crcs)
            trackers += self.ctx.send(job.identity, chunk, [data], True)
        return Completion(trackers)


class ZmqReceiver(ReceiverSide):
    def __init__(self, ctx: ReceiverContext, reply: HelloReply) -> None:
        self.pool = ctx.pool

    def on_data(self, pull: RecvPull, inbound: Inbound) -> bool:
        msg, frames = inbound.msg, inbound.frames
        if not isinstance(msg, Chunk):
            raise Rejected(Reason.UNEXPECTED, f"{msg.TAG} during a zmq pull")
        plan = pull.plan
        if msg.first_frame < pull.next_frame:
            raise Rejected(Reason.DUPLICATE, f"frame {msg.first_frame} already landed")
        if msg.first_frame > pull.next_frame:
            raise KVTransferError(
                Reason.BAD_FRAMES, f"frames {pull.next_frame}..{msg.first_frame - 1} missing"
            )
        n = len(frames)
        if n == 0 or n != len(msg.nbytes) or msg.first_frame + n > len(plan.frames):
            raise KVTransferError(
                Reason.BAD_FRAMES,
                f"{n} raw frames for {len(msg.nbytes)} declared at "
                f"{msg.first_frame} of {len(plan.frames)}",
            )
        if (pull.checksum or msg.crcs) and len(msg.crcs) != n:
            raise KVTransferError(Reason.BAD_FRAMES, "checksums missing or miscounted")
        # Validate every frame of the message before writing any.
        arrays = []
        for k, frame in enumerate(frames):
            expected = plan.frame_nbytes(msg.first_frame + k)
            arr = np.frombuffer(frame, dtype=np.uint8)
            if msg.nbytes[k] != expected or arr.nbytes != expected:
                raise KVTransferError(
                    Reason.BAD_FRAMES,
                    f"frame {msg.first_frame + k}: {arr.nbytes} bytes, header says "
                    f"{msg.nbytes[k]}, plan says {expected}",
                )
            if msg.crcs and zlib.crc32(arr.data) != msg.crcs[k]:
                raise KVTransferError(Reason.CHECKSUM, f"frame {msg.first_frame + k}")
            arrays.append(arr)
        bpb = plan.bytes_per_block
        for k, arr in enumerate(arrays):
            offset = 0
            for _src, dst, count in plan.frames[msg.first_frame + k]:
                nbytes = count * bpb
                np.copyto(
                    self.pool.byte_view(dst, count),
                    arr[offset : offset + nbytes].reshape(count, bpb),
                )
                offset += nbytes
        pull.next_frame += n
        return pull.next_frame == len(plan.frames)


ZMQ = TransportSpec(
    name="zmq",
    offered=lambda ctx: ctx.pool.bytes is not None,
    pair_ok=lambda local, reply: True,
    open_sender=ZmqSender,
    open_receiver=ZmqReceiver,
)
