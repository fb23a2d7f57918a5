"""``KVPull`` against a receiver whose pulls the test ends by hand: the reserved blocks are never
handed back (``cancel`` returned) while a pull may still write them."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.decode_worker.kv_pull import KVPull
from cluster.engine.handoff import KVReservation
from cluster.kv_transfer import KVTransferError, PullResult
from cluster.kv_transfer.protocol import Reason

pytestmark = pytest.mark.timeout(30)


class HandReceiver:
    """Each pull starts at once (as the I/O thread's would) and ends when the test says, or
    fails when aborted, the way the real receiver ends an aborted pull."""

    def __init__(self) -> None:
        self.pulls: list[Future[PullResult]] = []
        self.aborted: list[Any] = []

    def pull_async(self, params: Any, dst: list[int], **kw: Any) -> Future[PullResult]:
        fut: Future[PullResult] = Future()
        assert fut.set_running_or_notify_cancel()  # started: cancel() cannot stop it any more
        self.pulls.append(fut)
        return fut

    def hold(self, params: Any) -> None:
        pass

    def abort(self, params: Any, reason: str = "aborted") -> None:
        self.aborted.append(params)


def test_cancel_waits_for_the_last_pull_whose_caller_was_cancelled() -> None:
    """The stream awaiting ``finish`` is cancelled (a client gone) while its pull runs: the
    cleanup's ``cancel`` must still wait for that pull, or the engine frees blocks the receiver
    is writing and another request's KV is corrupted (L1's probe, which cancels after its first
    token, caught wrong tokens that way)."""
    receiver = HandReceiver()

    async def main() -> None:
        reservation: asyncio.Future[KVReservation] = asyncio.get_running_loop().create_future()
        reservation.set_result(KVReservation("r", [7, 8, 9], 0))
        pull = KVPull(receiver, reservation)  # type: ignore[arg-type]
        params = SimpleNamespace(block_ids=[1, 2, 3])
        finishing = asyncio.ensure_future(pull.finish(params))  # type: ignore[arg-type]
        while not receiver.pulls:
            await asyncio.sleep(0)
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        cancelling = asyncio.ensure_future(pull.cancel())
        await asyncio.sleep(0.05)
        assert receiver.aborted == [params]  # the receiver was told to stop the pull
        assert not cancelling.done()  # ... and the blocks wait until it has
        receiver.pulls[0].set_exception(KVTransferError(Reason.ABORTED, "aborted"))
        await asyncio.wait_for(cancelling, 5)

    asyncio.run(main())
