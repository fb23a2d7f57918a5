"""The collectives of a tensor-parallel engine's ranks on one host, over shared memory.

gloo over loopback TCP measured ~2.5 ms per all-reduce of a batch-8 hidden state here; a
sharded 30-layer step runs 61 of them. Ranks on one host instead meet in one shared region
(a memfd the driver creates; the other ranks open ``/proc/<driver pid>/fd/<fd>``):

    header   one 64-byte line per rank: [seq, length at even seq, length at odd seq] int64
    slots    2 (parity) x world x ``slot_bytes``: each rank's contribution to an operation
    pipes    (pipeline parallelism only) per rank, a queue of ``pipe_slots`` messages to it:
             [head, tail] in lines of their own, then the slots; one producer (the stage
             before it), one consumer (itself): ``send_to`` and ``recv``

Every operation takes the next sequence number ``seq``. A rank writes its contribution into its
slot of parity ``seq & 1``, then publishes ``seq`` in its line (x86 stores are not reordered
with later stores, and torch's copies are calls the interpreter completes first), and waits
until every line it reads shows ``seq``. Before writing, it waits until every rank has reached
``seq - 1``: nobody still reads the slots of ``seq - 2``, the same parity. The all-reduce sums
the slots in rank order on every rank, so every rank gets the same bits.

Waiting spins (each rank has its own cores), then yields; after 50 ms a rank waiting for rank
0's next message blocks on an eventfd rank 0 writes after each one (an idle engine's ranks
then cost nothing: sleeping in 1 ms steps instead woke each 1000 times a second, which took a
third off another engine's decode in the same process); other waits sleep in short steps. A
wait inside a step gives up after ``timeout_s``, or at once when ``peer_alive`` reports a rank
gone: the engine's step fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
from collections.abc import Callable
from functools import partial

import msgpack
import torch

from cluster.common import shared_regions

_LINE = 8  # int64s per rank's header line (64 bytes: one cache line each)
_HEADER_BYTES = 4096
MAX_RANKS = _HEADER_BYTES // (_LINE * 8)
SLOT_BYTES = 4 << 20  # each rank's slot per parity: an all-reduce moves this much per round
_SPIN_S = 0.002  # busy-wait this long before yielding, then sleeping


class RankFailure(RuntimeError):
    """A rank died or did not reach a collective in time: the engine cannot go on."""


class ShmGroup:
    """One rank's handle on the group's shared region (``create`` on rank 0, ``attach``
    elsewhere)."""

    def __init__(
        self,
        region: mmap.mmap,
        rank: int,
        world: int,
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
        peer_alive: Callable[[], str | None] | None = None,
        pipe_slots: int = 0,
    ) -> None:
        if not 1 <= world <= MAX_RANKS or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world}: at most {MAX_RANKS} ranks")
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.slot_bytes = slot_bytes
        self._region = region
        raw = torch.frombuffer(region, dtype=torch.uint8)
        self._lines = raw[: world * _LINE * 8].view(torch.int64).view(world, _LINE)
        body = raw[_HEADER_BYTES : _HEADER_BYTES + 2 * world * slot_bytes]
        self._slots = body.view(2, world, slot_bytes)
        self.pipe_slots = pipe_slots
        pipes = raw[_HEADER_BYTES + 2 * world * slot_bytes :]
        per = _pipe_bytes(pipe_slots, slot_bytes)
        self._pipes = (
            [_Pipe(pipes[r * per : (r + 1) * per], pipe_slots, slot_bytes) for r in range(world)]
            if pipe_slots
            else []
        )
        self._seq = int(self._lines[rank, 0])
        self.peer_alive = peer_alive or (lambda: None)
        self.path = ""
        self._fd = -1
        self.num_ops = 0  # operations so far, and the seconds spent waiting for other ranks
        self.wait_s = 0.0
        # Rank 0: an eventfd per other rank, written after each broadcast; another rank: its own
        # (``tp_ranks.spawn_ranks`` makes them), which its long waits for a message block on.
        self.wake_fds: list[int] = []
        self.wake_fd = -1

    @staticmethod
    def region_bytes(world: int, slot_bytes: int = SLOT_BYTES, pipe_slots: int = 0) -> int:
        return _HEADER_BYTES + 2 * world * slot_bytes + world * _pipe_bytes(pipe_slots, slot_bytes)

    @classmethod
    def create(
        cls, world: int, timeout_s: float, slot_bytes: int = SLOT_BYTES, pipe_slots: int = 0
    ) -> ShmGroup:
        """Rank 0's group: a new zeroed memfd region others attach to by ``path``."""
        size = cls.region_bytes(world, slot_bytes, pipe_slots)
        region, fd, path = shared_regions.new_region("pdserve-tp", size)
        group = cls(region, 0, world, timeout_s, slot_bytes, pipe_slots=pipe_slots)
        group.path, group._fd = path, fd
        return group

    @classmethod
    def attach(
        cls,
        path: str,
        rank: int,
        world: int,
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
        pipe_slots: int = 0,
    ) -> ShmGroup:
        region = shared_regions.map_region(path, cls.region_bytes(world, slot_bytes, pipe_slots))
        return cls(region, rank, world, timeout_s, slot_bytes, pipe_slots=pipe_slots)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- waiting ----------------------------------------------------------------------------

    def _wait(self, seq: int, ranks: range | list[int], deadline: float | None) -> None:
        """Until each of ``ranks`` has published ``seq`` or later."""
        t0 = time.perf_counter()
        for r in ranks:
            root = deadline is None and r == 0
            self._until(partial(self._reached, r, seq), deadline, partial(self._late, r, seq), root)
        self.wait_s += time.perf_counter() - t0

    def _reached(self, rank: int, seq: int) -> bool:
        return int(self._lines[rank, 0]) >= seq

    def _late(self, rank: int, seq: int) -> str:
        return (
            f"tensor-parallel rank {rank} did not reach collective {seq} within "
            f"{self.timeout_s:g} s (model.tensor_parallel_timeout_s): it hangs or died"
        )

    def _until(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        late: Callable[[], str],
        for_root: bool = False,
    ) -> None:
        """Until ``ready()``: spinning for ``_SPIN_S`` (the clock and the peers checked every
        256 reads), then dozing at every read (``_doze``). RankFailure when a peer is gone, or
        with ``late()`` past ``deadline``."""
        start = time.monotonic()
        spins = 0
        patient = False
        while not ready():
            spins += 1
            if spins & 255 and not patient:
                continue
            now = time.monotonic()
            gone = self.peer_alive()
            if gone is not None:
                raise RankFailure(gone)
            if deadline is not None and now > deadline:
                raise RankFailure(late())
            waited = now - start
            if waited > _SPIN_S:
                patient = True
                self._doze(waited, for_root)

    def _doze(self, waited: float, for_root: bool) -> None:
        """A pause in a long wait: a yield at first; then, waiting for rank 0's next message
        with a wake-up fd, blocking on it (rank 0 writes it after each message: an idle rank
        costs nothing and wakes at once); else a short sleep."""
        if waited < 0.05:
            time.sleep(0)
        elif for_root and self.wake_fd >= 0:
            ready, _, _ = select.select([self.wake_fd], [], [], 0.1)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self.wake_fd)
        else:
            time.sleep(min(0.001, waited / 100))

    def _begin(self, deadline: float | None) -> tuple[int, int]:
        """The next operation's seq and slot parity, once its slots are free to write."""
        seq = self._seq + 1
        if seq > 2:
            self._wait(seq - 1, range(self.world), deadline)
        self._seq = seq
        self.num_ops += 1
        return seq, seq & 1

    def _publish(self, seq: int, length: int) -> None:
        """Announce ``seq``, with a length read by the others (kept per parity: a rank ahead
        by one operation does not overwrite what a slower one still reads)."""
        line = self._lines[self.rank]
        line[1 + (seq & 1)] = length
        line[0] = seq

    def _length(self, rank: int, seq: int) -> int:
        return int(self._lines[rank, 1 + (seq & 1)])

    # -- operations -------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (contiguous fp32) summed across the ranks, in place, in rank order."""
        flat = t.view(-1)
        per = self.slot_bytes // 4
        deadline = time.monotonic() + self.timeout_s
        for a in range(0, flat.numel(), per):
            part = flat[a : a + per]
            seq, p = self._begin(deadline)
            mine = self._slots[p, self.rank, : part.numel() * 4].view(torch.float32)
            mine.copy_(part)
            self._publish(seq, part.numel())
            self._wait(seq, range(self.world), deadline)
            rows = self._slots[p, :, : part.numel() * 4].view(torch.float32)
            torch.sum(rows.view(self.world, -1), dim=0, out=part)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's 2-D ``t`` (rows equal, columns per rank) on rank 0, in rank order."""
        rows, cols = t.shape
        deadline = time.monotonic() + self.timeout_s
        seq, _ = self._begin(deadline)  # exchange the widths
        self._publish(seq, cols)
        self._wait(seq, range(self.world), deadline)
        widths = [self._length(r, seq) for r in range(self.world)]
        per = max(1, self.slot_bytes // (4 * max(widths)))
        out = [torch.empty((rows, w), dtype=t.dtype) for w in widths] if self.rank == 0 else None
        for a in range(0, rows, per):
            part = t[a : a + per]
            seq, p = self._begin(deadline)
            self._slots[p, self.rank, : part.numel() * 4].view(torch.float32).copy_(part.view(-1))
            self._publish(seq, part.numel())
            self._wait(seq, range(self.world), deadline)
            if out is not None:
                for r, w in enumerate(widths):
                    n = part.shape[0] * w
                    src = self._slots[p, r, : n * 4].view(torch.float32).view(-1, w)
                    out[r][a : a + part.shape[0]].copy_(src)
        return out

    def broadcast(self, message: object | None = None, timeout_s: float | None = None) -> object:
        """Rank 0 sends ``message`` (msgpack-able; waiting at most ``timeout_s``, default the
        group's, for the ranks to reach it); every rank returns it. The other ranks may wait
        indefinitely (an idle engine): only a peer's death ends their wait."""
        if self.rank == 0:
            data = msgpack.packb(message, use_bin_type=True)
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
            for a in range(0, max(1, len(data)), self.slot_bytes):
                part = data[a : a + self.slot_bytes]
                seq, p = self._begin(deadline)
                payload = torch.frombuffer(bytearray(part), dtype=torch.uint8)
                self._slots[p, 0, : len(part)].copy_(payload)
                more = int(a + self.slot_bytes < len(data)) << 62
                self._publish(seq, len(part) | more)
                for fd in self.wake_fds:
                    os.eventfd_write(fd, 1)
            return message
        chunks = []
        more = True
        while more:
            seq, p = self._begin(None)
            self._publish(seq, 0)
            self._wait(seq, [0], None)
            length = self._length(0, seq)
            more = bool(length >> 62)
            length &= (1 << 62) - 1
            chunks.append(bytes(self._slots[p, 0, :length].numpy()))
        return msgpack.unpackb(b"".join(chunks), raw=False, strict_map_key=False)

    # -- point to point (pipeline stages) ---------------------------------------------------

    def send_to(self, dst: int, t: torch.Tensor) -> None:
        """``t``'s bytes into rank ``dst``'s queue (in slot-sized messages), waiting while it is
        full; ``dst`` takes them with ``recv`` of the same shape."""
        pipe = self._pipes[dst]
        data = t.contiguous().view(-1).view(torch.uint8)
        deadline = time.monotonic() + self.timeout_s
        for a in range(0, max(1, data.numel()), self.slot_bytes):
            part = data[a : a + self.slot_bytes]
            self._until(
                lambda: pipe.head() - pipe.tail() < pipe.slots,
                deadline,
                _stuck(dst, self.timeout_s),
            )
            pipe.slot(pipe.head())[: part.numel()].copy_(part)
            pipe.advance_head()

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        """The next tensor sent to this rank, into ``out`` (its shape and dtype, contiguous)."""
        pipe = self._pipes[self.rank]
        data = out.view(-1).view(torch.uint8)
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        for a in range(0, max(1, data.numel()), self.slot_bytes):
            part = data[a : a + self.slot_bytes]
            self._until(
                lambda: pipe.head() > pipe.tail(), deadline, _stuck(self.rank, self.timeout_s)
            )
            part.copy_(pipe.slot(pipe.tail())[: part.numel()])
            pipe.advance_tail()
        self.wait_s += time.perf_counter() - t0
        return out


def _stuck(rank: int, timeout_s: float) -> Callable[[], str]:
    return lambda: (
        f"pipeline: rank {rank}'s queue did not move within {timeout_s:g} s "
        "(model.tensor_parallel_timeout_s): a stage hangs or died"
    )


def _pipe_bytes(pipe_slots: int, slot_bytes: int) -> int:
    return 128 + pipe_slots * slot_bytes if pipe_slots else 0


class _Pipe:
    """One rank's queue of messages: a single producer advances ``head``, the rank ``tail``."""

    def __init__(self, raw: torch.Tensor, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self._ends = raw[:128].view(torch.int64)  # head at [0], tail at [8]: separate lines
        self._data = raw[128 : 128 + slots * slot_bytes].view(slots, slot_bytes)

    def head(self) -> int:
        return int(self._ends[0])

    def tail(self) -> int:
        return int(self._ends[8])

    def slot(self, index: int) -> torch.Tensor:
        return self._data[index % self.slots]

    def advance_head(self) -> None:
        self._ends[0] += 1

    def advance_tail(self) -> None:
        self._ends[8] += 1
