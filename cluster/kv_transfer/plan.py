"""Which blocks travel in which frame: planned by the receiver, checked by the sender.

A frame is a list of segments ``(src_start, dst_start, count)``: blocks consecutive in BOTH pools
(one ``memcpy``, zero-copy send). Runs of consecutive ids coalesce into one frame up to the frame
size (and to a quarter of a transfer of 16 MiB or more, so frames pipeline); blocks smaller than
64 KiB (below pyzmq's zero-copy threshold) are packed several segments to a frame, so no frame
is under 64 KiB unless the whole transfer is.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.kv_transfer.pool import KVPool
from cluster.kv_transfer.protocol import (
    KVTransferError,
    KVTransferParams,
    Reason,
    Segment,
    check_params,
)

MIN_FRAME_BYTES = 1 << 16
# A transfer of at least PIPELINE_FRAMES * PIPELINE_MIN_FRAME_BYTES goes in at least
# PIPELINE_FRAMES frames, so the receiver copies one frame into its blocks while the next is
# still on the wire. A frame has a cost of its own (its header, a tracked zero-copy send, a
# wake-up of the receiver's thread), so it must carry a few MiB before splitting pays (the
# docs' design decisions, "KV frame sizes", have the measurements).
PIPELINE_FRAMES = 4
PIPELINE_MIN_FRAME_BYTES = 4 << 20
MAX_FRAMES = 1 << 14

# (first source block, first destination block, number of blocks)
Run = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class FramePlan:
    frames: tuple[tuple[Run, ...], ...]
    bytes_per_block: int

    @property
    def num_blocks(self) -> int:
        return sum(n for frame in self.frames for _, _, n in frame)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def frame_nbytes(self, i: int) -> int:
        return sum(n for _, _, n in self.frames[i]) * self.bytes_per_block

    def wire_frames(self) -> tuple[tuple[Segment, ...], ...]:
        """The source side of the plan, as a ``PullRequest`` carries it."""
        return tuple(tuple((s, n) for s, _, n in frame) for frame in self.frames)


def plan_frames(
    src_ids: Sequence[int], dst_ids: Sequence[int], bytes_per_block: int, max_frame_bytes: int
) -> FramePlan:
    assert len(src_ids) == len(dst_ids) and src_ids
    max_blocks = max(1, max_frame_bytes // bytes_per_block)
    if len(src_ids) * bytes_per_block >= PIPELINE_FRAMES * PIPELINE_MIN_FRAME_BYTES:
        max_blocks = min(max_blocks, -(-len(src_ids) // PIPELINE_FRAMES))
    frames = _pack_runs(_runs(src_ids, dst_ids, max_blocks), bytes_per_block, max_frame_bytes)
    return FramePlan(tuple(tuple(f) for f in frames), bytes_per_block)


def _runs(src_ids: Sequence[int], dst_ids: Sequence[int], max_blocks: int) -> list[list[int]]:
    """[src, dst, n] runs of blocks consecutive on both sides, at most ``max_blocks`` each."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        last = runs[-1] if runs else None
        if last and s == last[0] + last[2] and d == last[1] + last[2] and last[2] < max_blocks:
            last[2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def _pack_runs(
    runs: list[list[int]], bytes_per_block: int, max_frame_bytes: int
) -> list[list[Run]]:
    """Runs into frames: a run of ``MIN_FRAME_BYTES`` or more alone (zero-copy, never gathered),
    smaller ones gathered until they reach it (or would pass ``max_frame_bytes``)."""
    frames: list[list[Run]] = []
    pack: list[Run] = []
    pack_bytes = 0
    for s, d, n in runs:
        nbytes = n * bytes_per_block
        if pack and (nbytes >= MIN_FRAME_BYTES or pack_bytes + nbytes > max_frame_bytes):
            frames.append(pack)
            pack, pack_bytes = [], 0
        if nbytes >= MIN_FRAME_BYTES:  # big enough on its own: zero-copy, never gathered
            frames.append([(s, d, n)])
            continue
        pack.append((s, d, n))
        pack_bytes += nbytes
        if pack_bytes >= MIN_FRAME_BYTES:
            frames.append(pack)
            pack, pack_bytes = [], 0
    if pack:
        prev_bytes = sum(r[2] for r in frames[-1]) * bytes_per_block if frames else 0
        if frames and prev_bytes + pack_bytes <= max_frame_bytes:
            frames[-1].extend(pack)  # a small tail rides with the frame before it
        else:
            frames.append(pack)
    return frames


def check_source_frames(
    frames: Sequence[Sequence[Segment]],
    allowed: frozenset[int],
    num_blocks: int,
    bytes_per_block: int,
    max_frame_bytes: int,
) -> set[int]:
    """Sender side: every requested block is in the lease and the pool, once; frames fit.
    Returns the requested block ids."""
    if not frames or len(frames) > MAX_FRAMES:
        raise KVTransferError(Reason.BAD_BLOCKS, f"{len(frames)} frames requested")
    seen: set[int] = set()
    for frame in frames:
        if not frame:
            raise KVTransferError(Reason.BAD_BLOCKS, "empty frame in the plan")
        total = 0
        for start, count in frame:
            if count < 1 or start < 0 or start + count > num_blocks:
                raise KVTransferError(
                    Reason.BAD_BLOCKS, f"blocks {start}+{count} outside the pool ({num_blocks})"
                )
            for b in range(start, start + count):
                if b not in allowed:
                    raise KVTransferError(Reason.BAD_BLOCKS, f"block {b} is not in this lease")
                if b in seen:
                    raise KVTransferError(Reason.BAD_BLOCKS, f"block {b} requested twice")
                seen.add(b)
            total += count * bytes_per_block
        if total > max_frame_bytes:
            raise KVTransferError(Reason.BAD_BLOCKS, f"a frame of {total} bytes exceeds the limit")
    return seen


def crc_segments(views: Sequence[memoryview | object]) -> int:
    """crc32 of a frame as the concatenation of its segments' bytes (same on both sides)."""
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)  # type: ignore[arg-type]
    return crc


def check_pull_request(
    pool: KVPool, params: KVTransferParams, dst_block_ids: Sequence[int], first_block: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Receiver side, before anything is queued: (source ids, destination ids) or an error."""
    check_params(params)  # a KVTransferParams of this protocol version
    mismatch = pool.layout.mismatch(params.layout)
    if mismatch is not None:
        raise KVTransferError(Reason.LAYOUT_MISMATCH, f"KV layout differs: {mismatch}")
    if not 0 <= first_block < len(params.block_ids):
        raise KVTransferError(
            Reason.BAD_DESTINATION,
            f"first_block {first_block}: nothing to pull of {len(params.block_ids)} blocks "
            "(abort(params) releases a lease that is not needed)",
        )
    src = params.block_ids[first_block:]
    dst = tuple(map(int, dst_block_ids))
    if len(dst) != len(src):
        raise KVTransferError(
            Reason.BAD_DESTINATION, f"{len(dst)} destination blocks for {len(src)} to pull"
        )
    if len(set(dst)) != len(dst) or min(dst) < 0 or max(dst) >= pool.num_blocks:
        raise KVTransferError(
            Reason.BAD_DESTINATION, f"destination ids repeat or leave the pool: {dst[:8]}"
        )
    return src, dst
