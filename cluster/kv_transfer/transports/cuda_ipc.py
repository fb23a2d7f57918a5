"""``cuda_ipc``: a receiver on the same GPU host copies straight out of the sender's device pool.

Two processes on one GPU cannot form an NCCL pair (NCCL refuses two ranks on one device), so
``torch_dist`` cannot hand KV between a prefill and a decode replica sharing a GPU. Here the
sender exports its pool's device allocation through CUDA IPC (torch's own tensor sharing,
``cudaIpcGetMemHandle`` underneath) in its ``HelloReply``; a receiver on the same host opens it
once per connection and, on ``Ready``, copies its planned segments device to device into its
destination blocks: one copy, no KV byte through host memory or a socket. As for shm, the pull
is DONE only once the sender confirms the lease was still held at the ack (``needs_confirm``).

Offered only when the sender's pool is on a CUDA device; the pair needs one host (host id).
Checksums (debugging) are computed on host copies of the blocks.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from cluster.kv_transfer.framing import Inbound
from cluster.kv_transfer.plan import crc_segments
from cluster.kv_transfer.pool import TORCH_DTYPES, KVPool
from cluster.kv_transfer.protocol import MAX_STR_LEN, HelloReply, KVTransferError, Ready, Reason
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


def export_pool(pool: KVPool) -> str:
    """The pool's CUDA IPC handle as a plain string for ``HelloReply.cuda_ipc`` ("" on CPU)."""
    if not pool.tensor.is_cuda:
        return ""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(pool.tensor)
    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
    #  offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
    #  event_sync_required): classes and the dtype are known on the other side; bytes as hex.
    plain = [_plain(a) for i, a in enumerate(args) if i not in (0, 4, 5)]
    text = json.dumps(plain, separators=(",", ":"))
    if len(text) > MAX_STR_LEN:
        raise ValueError(f"cuda_ipc: the exported handle is {len(text)} characters")
    return text


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, torch.Size | tuple | list):
        return [_plain(v) for v in value]
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    if isinstance(value, list):
        return tuple(_unplain(v) for v in value)
    return value


def import_pool(text: str, dtype: torch.dtype) -> torch.Tensor:
    """The sender's pool tensor, mapped into this process (same host; a CUDA device here)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        size, stride, offset, device, handle, nbytes, off_bytes, grad, ref, ref_off, ev, sync = (
            _unplain(v) for v in json.loads(text)
        )
    except (ValueError, TypeError, KeyError) as e:
        raise KVTransferError(Reason.MALFORMED, f"cuda_ipc: unreadable handle ({e})") from None
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(size),
        tuple(stride),
        offset,
        torch.storage.TypedStorage,
        dtype,
        device,
        handle,
        nbytes,
        off_bytes,
        grad,
        ref,
        ref_off,
        ev,
        sync,
    )


def _host_crc(blocks: list[torch.Tensor]) -> int:
    return crc_segments([b.contiguous().view(torch.uint8).cpu().numpy().data for b in blocks])


class CudaReadySender(SenderSide):
    def __init__(self, ctx: SenderContext, peer: PeerInfo) -> None:
        self.ctx = ctx

    def serve(self, job: ServeJob) -> Completion:
        pool = self.ctx.pool
        crcs: tuple[int, ...] = ()
        if job.pull.checksum:
            crcs = tuple(
                _host_crc([pool.block_tensor(s, n) for s, n in frame]) for frame in job.frames
            )
        # The engine's writes to these blocks were on its stream: make them visible first.
        torch.cuda.synchronize(pool.tensor.device)
        self.ctx.send(job.identity, Ready(job.pull.pull_id, crcs), [], False)
        return Completion()  # the reader is the receiver; the ack confirmation guards it


class CudaReadReceiver(ReceiverSide):
    needs_confirm = True

    def __init__(self, ctx: ReceiverContext, source: torch.Tensor) -> None:
        self.pool = ctx.pool
        self.source = source  # the sender's pool: [num_blocks, *block_shape], read only

    def on_data(self, pull: RecvPull, inbound: Inbound) -> bool:
        msg = check_ready(pull, inbound, "cuda_ipc", repeated=pull.next_frame > 0)
        plan = pull.plan
        check_sources(plan, int(self.source.shape[0]))
        dst_pool = self.pool.tensor
        for frame in plan.frames:
            for src, dst, count in frame:
                dst_pool[dst : dst + count].copy_(self.source[src : src + count], non_blocking=True)
        torch.cuda.synchronize(dst_pool.device)
        for i, frame in enumerate(plan.frames if msg.crcs else ()):
            got = _host_crc([self.pool.block_tensor(d, n) for _, d, n in frame])
            if got != msg.crcs[i]:
                raise KVTransferError(Reason.CHECKSUM, f"frame {i}")
        pull.next_frame = len(plan.frames)
        return True

    def close(self) -> None:
        self.source = torch.empty(0)


def _open(ctx: ReceiverContext, reply: HelloReply) -> ReceiverSide:
    if not ctx.pool.tensor.is_cuda:
        raise KVTransferError(Reason.NO_TRANSPORT, "cuda_ipc: this pool is not on a CUDA device")
    dtype = TORCH_DTYPES[ctx.pool.layout.dtype]
    try:
        source = import_pool(reply.cuda_ipc, dtype)
    except (RuntimeError, OSError) as e:
        raise KVTransferError(Reason.NO_TRANSPORT, f"cuda_ipc: cannot open the pool: {e}") from e
    expected = (reply.num_blocks, *ctx.pool.layout.block_shape)
    if tuple(source.shape) != expected:
        raise KVTransferError(
            Reason.LAYOUT_MISMATCH, f"cuda_ipc: pool {tuple(source.shape)}, expected {expected}"
        )
    return CudaReadReceiver(ctx, source)


CUDA_IPC = TransportSpec(
    name="cuda_ipc",
    offered=lambda ctx: bool(ctx.cuda_ipc),
    pair_ok=lambda local, reply: local.host_id == reply.host_id and bool(reply.cuda_ipc),
    open_sender=CudaReadySender,
    open_receiver=_open,
    needs_confirm=True,
)
