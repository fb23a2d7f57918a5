"""Live migration of decoding requests between decode replicas (the KV moves, the stream goes on).

Source (the replica being drained: scale-down, upgrade, ``pdserve drain``), per request:
  1. ``Departure.start``: the engine pauses the request between steps (``migrate_out``: off the
     running batch, its blocks kept) and its KV (prompt and every output but the last) is leased
     on this replica's KV sender, with ``decode.migration_claim_s`` to be claimed.
  2. The request's stream yields ``Migrating(resume)`` after every chunk already produced; the
     router calls the decode pool with ``resume`` (this replica excluded).
  3. The lease ends: acked (the target pulled the KV) -> the request is freed here and this
     stream ends; anything else (no replica took it, the target had no room, failed or died
     mid-pull: aborted or expired) -> the request rejoins this engine's batch and its chunks go
     on from here. The router keeps whichever stream goes on (both would be the same tokens:
     sampling is keyed by seed and output index).

Target (``RequestHandoff._take_over``): adds the request to the engine with the tokens the client
has (taken in without an output: stop strings, detokenizer and grammar replayed), reserves blocks
(its cached prefix first), pulls the rest into them and lets it decode; no room within the claim
window, or a failed pull, fails the call (UNAVAILABLE) and aborts the lease, so the source
decodes on at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cluster.engine.client import EngineClient
from cluster.engine.handoff import MigrationExport
from cluster.kv_transfer import KVSender, KVTransferParams

logger = logging.getLogger(__name__)
ACKED = "acked"  # the lease's release reason when the target pulled it (``ReleaseReason``)
END_WAIT_S = 10.0  # an aborted lease's release: at most a transfer's tail (it never frees early)


@dataclass(slots=True)
class Departure:
    """One request leaving this replica: its export, its lease, and the lease's end."""

    export: MigrationExport
    kv: KVTransferParams
    ended: asyncio.Future[str]  # the lease's release reason (set from the sender's thread)


class Departures:
    """The source side of this replica's migrations: leases on its KV sender, and their ends."""

    def __init__(self, sender: KVSender, claim_s: float) -> None:
        self.sender = sender
        self.claim_s = claim_s
        self._ended: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[str]]] = {}

    async def start(
        self, engine: EngineClient, rid: str, ending: Callable[[], bool]
    ) -> Departure | None:
        """Pause request ``rid`` and lease its KV; None when it cannot move now."""
        export = await engine.migrate_out(rid)
        if export is None:
            return None
        if ending():  # its stream ended meanwhile: the stream's abort frees the request
            return None
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()
        self._ended[rid] = (loop, ended)
        try:
            kv = self.sender.register(
                rid,
                export.block_ids,
                num_tokens=export.num_kv_tokens,
                block_hashes=export.block_hashes,
                claim_s=self.claim_s,
            )
        except Exception:  # (a lease still held under this id: never expected)
            logger.exception("request %s: could not lease its KV for migration", rid)
            self._ended.pop(rid, None)
            await asyncio.wrap_future(engine.migration_ended(rid, moved=False))
            return None
        return Departure(export, kv, ended)

    def on_release(self, request_id: str, reason: str) -> None:
        """The sender's thread: a migration lease ended (acked, expired, aborted, closed)."""
        entry = self._ended.pop(request_id, None)
        if entry is not None:
            loop, fut = entry
            loop.call_soon_threadsafe(_set_once, fut, reason)

    async def finish(
        self, engine: EngineClient, rid: str, departure: Departure, counters: dict[str, int]
    ) -> bool:
        """Wait for the lease's end; True: moved (freed here), False: decoding on here."""
        reason = await departure.ended
        moved = reason == ACKED
        await asyncio.wrap_future(engine.migration_ended(rid, moved))
        counters["migrated_out" if moved else "migrations_resumed"] += 1
        logger.info("request %s: migration %s (%s)", rid, "done" if moved else "not taken", reason)
        return moved

    async def abandon(
        self, engine: EngineClient, rid: str, departure: Departure, counters: dict[str, int]
    ) -> bool:
        """The stream ends while migrating (the router kept the target's stream, the client
        left, a deadline): end the lease unless it ended, wait until no transport reads the
        blocks, then settle the request as ``finish`` does. True: it was moved (the caller
        must not abort it); False: the caller aborts it."""
        if not departure.ended.done():
            self.sender.abort(rid)
            try:
                async with asyncio.timeout(END_WAIT_S):
                    await asyncio.shield(departure.ended)
            except TimeoutError:
                logger.error("request %s: its migration lease did not end", rid)
                return False
        return await self.finish(engine, rid, departure, counters)

    def refuse(self, request_id: str) -> None:
        """A call to take over a request leaving this replica came back here (no other replica
        to take it): end its lease now, so it decodes on here at once."""
        self.sender.abort(request_id)


def _set_once(fut: asyncio.Future[str], reason: str) -> None:
    if not fut.done():
        fut.set_result(reason)


__all__ = ["ACKED", "Departure", "Departures"]
