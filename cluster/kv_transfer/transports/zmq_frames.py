"""``zmq``: KV frames on the control connection itself (tcp across hosts, ipc on one host).

The sender sends the planned frames in order, each a raw part zero-copy from its pool (pyzmq
copies nothing above 64 KiB; the lease stays held until zmq reports every part handed off),
consecutive frames grouped into one message of ``Chunk`` + several parts (``messages``): a
scattered pull plans one frame per block, and a message per block costs each side a wake-up
and a header. P4, 512 tokens of scattered blocks over zmq ipc (32 frames), the two sides on a
core each, three pairs of quick runs alternating: ``zmq_ipc_vs_raw_512_frag`` 0.49-0.53 in 4
messages against 0.39-0.43 in 32. Contiguous pulls keep one frame a message, so a large one
still arrives in several. The receiver validates each chunk against its plan (order, count,
byte lengths, crc32) before the one copy of its frames into the destination blocks, while later
messages are still arriving.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from cluster.kv_transfer.framing import Buffer, Inbound
from cluster.kv_transfer.plan import PIPELINE_FRAMES, PIPELINE_MIN_FRAME_BYTES, crc_segments
from cluster.kv_transfer.protocol import Chunk, HelloReply, KVTransferError, Reason
from cluster.kv_transfer.transports.base import (
    Completion,
    PeerInfo,
    ReceiverContext,
    ReceiverSide,
    RecvPull,
    Rejected,
    SenderContext,
    SenderSide,
    ServeJob,
    TransportSpec,
)

FAULT_MID_SEND = "p.mid_send_frame_k"


def messages(frame_bytes: Sequence[int], max_bytes: int) -> list[range]:
    """The planned frames (their byte sizes, in order) grouped into messages: consecutive frames
    while a message stays within a budget of a quarter of the pull (so a large pull still comes
    in several messages, the receiver copying one while the next arrives), at least
    ``PIPELINE_MIN_FRAME_BYTES`` (small pulls: one message) and at most ``max_bytes`` (the
    frame limit), never below the largest frame (which then goes alone)."""
    largest = max(frame_bytes, default=0)
    budget = max(sum(frame_bytes) // PIPELINE_FRAMES, PIPELINE_MIN_FRAME_BYTES)
    budget = max(largest, min(budget, max_bytes))
    groups: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(frame_bytes):
        if i > start and size + n > budget:
            groups.append(range(start, i))
            start, size = i, 0
        size += n
    if frame_bytes:
        groups.append(range(start, len(frame_bytes)))
    return groups


class ZmqSender(SenderSide):
    def __init__(self, ctx: SenderContext, peer: PeerInfo) -> None:
        self.ctx = ctx

    def serve(self, job: ServeJob) -> Completion:
        pool, pull = self.ctx.pool, job.pull
        bpb = pool.bytes_per_block
        sizes = [sum(count for _, count in frame) * bpb for frame in job.frames]
        trackers = []
        for group in messages(sizes, self.ctx.config.max_frame_bytes):
            parts, crcs = [], []
            for i in group:
                self.ctx.fault_points.hit(FAULT_MID_SEND)
                views = [pool.byte_view(start, count).reshape(-1) for start, count in job.frames[i]]
                parts.append(views[0] if len(views) == 1 else np.concatenate(views))  # small
                if pull.checksum:
                    crcs.append(crc_segments(views))
            chunk = Chunk(pull.pull_id, group.start, tuple(p.nbytes for p in parts), tuple(crcs))
            trackers += self.ctx.send(job.identity, chunk, parts, True)
        return Completion(trackers)


class ZmqReceiver(ReceiverSide):
    def __init__(self, ctx: ReceiverContext, reply: HelloReply) -> None:
        self.pool = ctx.pool

    def on_data(self, pull: RecvPull, inbound: Inbound) -> bool:
        msg = inbound.msg
        if not isinstance(msg, Chunk):
            raise Rejected(Reason.UNEXPECTED, f"{msg.TAG} during a zmq pull")
        arrays = _checked_frames(pull, msg, inbound.frames)  # every frame, before writing any
        plan, bpb = pull.plan, pull.plan.bytes_per_block
        for k, arr in enumerate(arrays):
            offset = 0
            for _src, dst, count in plan.frames[msg.first_frame + k]:
                nbytes = count * bpb
                np.copyto(
                    self.pool.byte_view(dst, count),
                    arr[offset : offset + nbytes].reshape(count, bpb),
                )
                offset += nbytes
        pull.next_frame += len(arrays)
        return pull.next_frame == len(plan.frames)


def _checked_frames(pull: RecvPull, msg: Chunk, frames: Sequence[Buffer]) -> list[np.ndarray]:
    """The raw frames of ``msg`` as byte arrays, each checked against the pull's plan: the next
    frames in order, the sizes the header and the plan give, the checksums when sent."""
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
    return arrays


ZMQ = TransportSpec(
    name="zmq",
    offered=lambda ctx: ctx.pool.bytes is not None,
    pair_ok=lambda local, reply: True,
    open_sender=ZmqSender,
    open_receiver=ZmqReceiver,
)
