"""``EngineClient``: the one typed way a pool replica talks to its engine.

The engine runs on its own step-loop thread (``step_loop.EngineLoop``); every method here is safe
from an asyncio event loop or any other thread, and nothing outside ``cluster.engine`` reaches
the engine, its scheduler or its block manager directly. The async methods await the engine
thread's answer; ``abort`` and ``release`` are fire-and-forget (their Future may be ignored).

Entries into the engine thread for one request:
  * local prefill: ``add``;
  * remote prefill (decode role): ``add`` (which also says local or remote and how much of the
    prompt is cached here), then ``kv_arrived`` with the prefill replica's first tokens once the
    KV is here (or at once when the first token ended the request: nothing to pull); the block
    reservation in between goes into the Future ``add`` returned: resolved with the add itself
    when the running batch's next step leaves the blocks free, else by the step loop after a
    later step. The first tokens reach the client from the prefill reply, not from here;
  * prefill role: ``add``, then ``release`` once the KV was pulled (the output that ends the
    request here carries the held block table).
Failure paths end with ``kv_failed`` (instead of ``kv_arrived``) or ``abort``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from cluster.common.kv_layout import KVLayout
from cluster.common.protocol import FirstToken
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.handoff import KVReservation, MigrationExport
from cluster.engine.step_loop import EngineLoop, Sink


@dataclass(frozen=True, slots=True)
class Added:
    """What ``add`` decided: the caller needs no second round trip to ask."""

    num_cached_tokens: int  # prompt tokens this engine's prefix cache held at admission
    remote: bool  # the prompt's KV comes from a prefill replica
    # Remote only: resolves (on the caller's event loop) once the engine reserved the blocks.
    reservation: asyncio.Future[KVReservation] | None


class EngineClient:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        name: str = "engine-loop",
        before_step: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine  # touched only on the loop thread, through self._loop
        self._loop = EngineLoop(
            engine, name=name, before_step=before_step, after_step=self._hand_out_reservations
        )
        self._reservations: dict[str, asyncio.Future[KVReservation]] = {}
        self._lock = threading.Lock()  # the reservation table: engine thread and event loop
        self.kv_cache: torch.Tensor = engine.runner.kv_cache  # the pool the KV transfer uses
        self.kv_layout: KVLayout = engine.runner.layout
        self.block_size = engine.config.cache.block_size
        self.vocab_size: int = engine.vocab_size

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EngineClient:
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop()
        self._engine.close()

    def is_alive(self) -> bool:
        """The loop thread runs and the runner's other processes live (a tensor-parallel
        engine's ranks: one that died is seen here, not only at the next step)."""
        return self._loop.is_alive() and self._engine.runner_problem() is None

    @property
    def fatal_error(self) -> str | None:
        return self._loop.fatal_error

    # -- requests -----------------------------------------------------------------------------

    async def add(self, request: EngineRequest, sink: Sink) -> Added:
        """Queue a request whose outputs go to ``sink`` (on the engine thread: must not block);
        ``n`` samples of it stream their outputs (``RequestOutput.index``) to the one sink.

        Raises ``ValueError`` naming the bad field; nothing is left behind then.
        """
        request_id = request.request_id
        reservation: asyncio.Future[KVReservation] | None = None
        if request.prefill != "local":  # registered first: the very next step may reserve
            reservation = asyncio.get_running_loop().create_future()
            with self._lock:
                self._reservations[request_id] = reservation
            # However it ends (reserved, cancelled by the caller, timed out), it leaves the table.
            reservation.add_done_callback(lambda fut: self._discard(request_id, fut))
        added = self._loop.add(request, sink)
        try:
            decision = await asyncio.wrap_future(added)
        except BaseException:
            self._forget_reservation(request_id)
            # Cancelled while (or just after) the engine thread admitted it: the caller never
            # learns it is in the engine, so nobody else would abort it. Queued behind the add,
            # this runs once the add's outcome is known and aborts only what it admitted (an id
            # refused as a duplicate belongs to another request).
            self._loop.call(lambda eng: _abort_if_admitted(eng, request_id, added))
            raise
        if not decision.remote:
            self._forget_reservation(request_id)
            reservation = None
        return Added(decision.num_cached_tokens, decision.remote, reservation)

    async def kv_arrived(self, request_id: str, first_tokens: Sequence[FirstToken]) -> None:
        """Decode role: the prefill replica's first tokens (the caller streamed them already),
        and, unless the first one ended the request, its prompt's KV in the reserved blocks:
        the request may decode (``LLMEngine.kv_arrived``)."""
        await asyncio.wrap_future(
            self._loop.call_ending(lambda eng: eng.kv_arrived(request_id, first_tokens))
        )

    async def kv_failed(
        self,
        request_id: str,
        *,
        recompute: bool,
        error: str,
        first_tokens: Sequence[FirstToken] = (),
    ) -> None:
        """Decode role: the prefill call or the pull failed: prefill locally (after the first
        tokens the client already has, if any), or fail it."""
        self._forget_reservation(request_id)
        await asyncio.wrap_future(
            self._loop.call_ending(
                lambda eng: eng.kv_failed(request_id, recompute, error, first_tokens)
            )
        )

    async def migrate_out(self, request_id: str) -> MigrationExport | None:
        """Decode role: pause a decoding request for live migration (``LLMEngine.migrate_out``).
        Its outputs of earlier steps reach its sink before this returns."""
        export: MigrationExport | None = await self._call(lambda eng: eng.migrate_out(request_id))
        return export

    def migration_ended(self, request_id: str, moved: bool) -> Future[bool]:
        """A paused request's migration is over: freed here (``moved``) or decoding on (any
        thread)."""
        return self._loop.call(lambda eng: eng.migration_ended(request_id, moved))

    def abort(self, request_id: str) -> Future[bool]:
        """End a request wherever it is; frees its blocks (any thread, fire-and-forget)."""
        self._forget_reservation(request_id)
        return self._loop.abort(request_id)

    def release(self, request_id: str) -> Future[bool]:
        """Prefill role: free a held block table (pulled, expired, cancelled; any thread)."""
        return self._loop.call(lambda eng: eng.release(request_id))

    # -- introspection ------------------------------------------------------------------------

    async def cached_block_hashes(self) -> list[int]:
        """Every block hash this engine's prefix cache holds (what routers index)."""
        return await self._call(lambda eng: eng.block_manager.cached_hashes())

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (no hop to the engine thread)."""
        return self._loop.stats()

    @property
    def peak_running(self) -> int:
        return self._loop.peak_running

    def check_integrity(self, timeout_s: float = 30.0) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (blocks, requests)."""
        self._loop.call(lambda eng: eng.check_integrity()).result(timeout=timeout_s)

    # -- internals ----------------------------------------------------------------------------

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self._loop.call(fn))

    def _hand_out_reservations(self, engine: LLMEngine) -> None:
        """Engine thread, after each step: give new block reservations to their waiting calls."""
        for res in engine.take_reservations():
            with self._lock:
                fut = self._reservations.pop(res.request_id, None)
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(_resolve, fut, res)

    def _discard(self, request_id: str, fut: asyncio.Future[KVReservation]) -> None:
        with self._lock:
            if self._reservations.get(request_id) is fut:
                del self._reservations[request_id]

    def _forget_reservation(self, request_id: str) -> None:
        with self._lock:
            fut = self._reservations.pop(request_id, None)
        if fut is not None:
            fut.get_loop().call_soon_threadsafe(fut.cancel)


def _abort_if_admitted(engine: LLMEngine, request_id: str, added: Future[Any]) -> bool:
    if added.cancelled() or added.exception() is not None:
        return False  # never admitted (skipped, or refused): nothing of it is in the engine
    return engine.abort_request(request_id)


def _resolve(fut: asyncio.Future[KVReservation], res: KVReservation) -> None:
    if not fut.done():
        fut.set_result(res)
