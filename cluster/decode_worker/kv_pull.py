"""One remote request's pull of its prompt KV into the blocks reserved for it on this replica.

A bulk prompt is pulled once, after its first token (``finish``). A streamed prompt (the prefill
replica announces its blocks as its chunks finish: ``offer``) is pulled in parts as they come,
once the engine reserved the request's blocks, each part a ``final=False`` pull of the blocks
announced since the last one, so that after the first token only the tail moves. Blocks cached
here (the reservation's leading hits) are never pulled; every other block is pulled exactly once.

Threads: everything here runs on the replica's event loop; the pulls themselves run on the
receiver's I/O thread. Before the reserved blocks may be freed or reused (failure, cancel),
``cancel`` aborts the pull in flight and waits until nothing writes them any more.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future

from cluster.engine.handoff import KVReservation
from cluster.kv_transfer import KVReceiver, KVTransferError, KVTransferParams, PullResult


class KVPull:
    def __init__(self, receiver: KVReceiver, reservation: asyncio.Future[KVReservation]) -> None:
        self.receiver = receiver
        self.reservation = reservation
        self.params: KVTransferParams | None = None  # the lease as last announced
        self.next_block = 0  # leading prompt blocks already here (cached, or pulled)
        self.num_parts = 0  # pulls made before the last one
        self.num_pulled = 0  # blocks pulled in all
        self._wake = asyncio.Event()
        self._parts: asyncio.Task[None] | None = None
        self._in_flight: Future[PullResult] | None = None
        self._last = False  # the last pull is due: the parts loop stops
        # The lease needs no abort from here: acked, given up, or its pull failed (the receiver
        # then told the sender itself).
        self._settled = False
        # ``finish`` ended the lease from here (its last pull's ack, or an abort when nothing
        # was left to pull): the prefill call ends once the sender reads that.
        self._finished = False

    # -- while the prefill runs ---------------------------------------------------------------

    def offer(self, params: KVTransferParams) -> None:
        """The prefill replica leased more blocks (a streamed prompt): pull them soon."""
        self.hold(params)
        if self._parts is None:
            self._parts = asyncio.create_task(self._pull_parts())
        self._wake.set()

    async def _pull_parts(self) -> None:
        res = await self.reservation
        self.next_block = max(self.next_block, res.num_hit_blocks)
        while not self._last:
            params = self.params
            assert params is not None
            if len(params.block_ids) > self.next_block:
                await self._pull(params, res, final=False)
                self.num_parts += 1
            else:
                self._wake.clear()
                await self._wake.wait()

    # -- after the first token ----------------------------------------------------------------

    def hold(self, params: KVTransferParams) -> None:
        """Heartbeat the lease while the request waits (for its blocks, or between parts)."""
        if self.params is None:
            self.receiver.hold(params)
        self.params = params

    async def finish(self, params: KVTransferParams) -> int:
        """``params`` names every block: pull what is not here yet (the tail; everything for a
        bulk prompt), ending the lease. Returns how many blocks came from this replica's cache.
        Raises ``KVTransferError``; the caller awaits ``cancel`` before reusing the blocks."""
        self.hold(params)
        self._last = True
        if self._parts is not None:
            self._wake.set()
            await self._parts  # the part in flight, if any, completes first; a failure raises
        res = await self.reservation
        reused = min(res.num_hit_blocks, len(params.block_ids))
        self.next_block = max(self.next_block, reused)
        if self.next_block < len(params.block_ids):
            await self._pull(params, res, final=True)
        else:
            self.receiver.abort(params, reason="not_needed")  # all here already: release it
        self._settled = self._finished = True
        return reused

    async def _pull(self, params: KVTransferParams, res: KVReservation, *, final: bool) -> None:
        k, n = self.next_block, len(params.block_ids)
        fut = self.receiver.pull_async(params, res.block_ids[k:n], first_block=k, final=final)
        self._in_flight = fut
        try:
            result = await asyncio.wrap_future(fut)
        except KVTransferError:
            self._settled = True  # the receiver told the sender (or the sender is gone)
            raise
        finally:
            # A cancelled await leaves a started pull still writing the reserved blocks:
            # it stays in flight, for ``cancel`` to wait on, until the receiver ends it.
            if fut.done():
                self._in_flight = None
        self.next_block = n
        self.num_pulled += result.num_blocks

    # -- failure ------------------------------------------------------------------------------

    async def cancel(self) -> None:
        """Stop: abort the lease and any pull in flight, and wait until none writes the
        reserved blocks any more (then the caller may free or recompute into them)."""
        self._last = True
        if self.params is not None and not self._settled:
            self._settled = True
            self.receiver.abort(self.params)
        if self._parts is not None and not self._parts.done():
            self._parts.cancel()
        if self._parts is not None:
            with contextlib.suppress(asyncio.CancelledError, KVTransferError):
                await self._parts
        in_flight = self._in_flight  # a part's, or the last pull's (its caller was cancelled)
        if in_flight is not None:
            with contextlib.suppress(KVTransferError, asyncio.CancelledError):
                await asyncio.wrap_future(in_flight)

    @property
    def settled(self) -> bool:
        """Nothing of the lease is left to abort from here (acked, given up, or failed)."""
        return self._settled

    @property
    def finished(self) -> bool:
        """``finish`` returned: every block is here and the sender was told (an ack, or an abort
        when nothing was left to pull). Over a pushed transport (zmq) nothing confirms the ack,
        so the sender may read it only after this request is done."""
        return self._finished
