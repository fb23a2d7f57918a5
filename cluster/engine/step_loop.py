"""The engine's step loop in one dedicated thread: the only thread that touches the engine.

Other threads reach it through ``call(fn)``, which runs ``fn(engine)`` on the loop thread between
steps and returns a Future; servers use the typed ``client.EngineClient`` on top of it. Each
request's outputs go to the sink registered with it, called on the loop thread: sinks must not
block (an asyncio server hands them to its event loop with ``call_soon_threadsafe``).

Liveness (``is_alive``) covers the thread itself, a fatal error, and a heartbeat stamped every
iteration, so a wedged step turns the replica's health check red. A step that raises fails every
in-flight request with a clear error and stops the loop: the supervisor replaces the process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from cluster.engine.engine import EngineRequest, LLMEngine, PrefillDecision, RequestOutput
from cluster.engine.parallel import sample_ids

logger = logging.getLogger(__name__)

T = TypeVar("T")
Sink = Callable[[RequestOutput], None]


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        name: str = "engine-loop",
        idle_wait_s: float = 0.05,
        liveness_s: float = 60.0,
        before_step: Callable[[], None] | None = None,
        after_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._liveness_s = liveness_s
        self._before_step = before_step  # fault-injection hook (tests)
        # After each step and each add (an admission may reserve blocks at once): e.g. hand new
        # KV reservations to the transfer side.
        self._after_step = after_step
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.heartbeat = time.monotonic()
        self.fatal_error: str | None = None
        self.peak_running = 0
        self._stats: dict[str, Any] = engine.stats()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return (
            self._thread.is_alive()
            and self.fatal_error is None
            and time.monotonic() - self.heartbeat < self._liveness_s
        )

    # -- the API other threads use ------------------------------------------------------------

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread; its result or exception lands in the Future."""
        fut: Future[T] = Future()
        if self.fatal_error is not None or self._stop.is_set():
            fut.set_exception(EngineDeadError(self.fatal_error or "engine loop stopped"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        if self._thread.ident is not None and not self._thread.is_alive():
            self._fail_pending_commands()  # the loop died between the check and the put
        return fut

    def add(self, request: EngineRequest, sink: Sink) -> Future[PrefillDecision]:
        """Queue a request whose outputs (of each of its ``n`` samples) go to ``sink``;
        ``ValueError`` for bad input."""

        def add(engine: LLMEngine) -> PrefillDecision:
            decision = engine.add(request)
            for rid in sample_ids(request.request_id, request.n):
                self._sinks[rid] = sink
            if self._after_step is not None:
                self._after_step(engine)
            return decision

        return self.call(add)

    def call_ending(self, fn: Callable[[LLMEngine], list[str]]) -> Future[list[str]]:
        """``call`` for an entry that may end requests without an output (``kv_arrived``,
        ``kv_failed``: their ends went to the client another way); ``fn`` returns their ids,
        whose sinks go with them."""

        def ending(engine: LLMEngine) -> list[str]:
            ended = fn(engine)
            for rid in ended:
                self._sinks.pop(rid, None)
            return ended

        return self.call(ending)

    def abort(self, request_id: str) -> Future[bool]:
        return self.call(lambda engine: engine.abort_request(request_id))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the last step (safe from any thread)."""
        return dict(self._stats, peak_running=self.peak_running, alive=self.is_alive())

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._stats = engine.stats()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                if self._before_step is not None:
                    self._before_step()
                outputs = engine.step()
                self.peak_running = max(self.peak_running, len(engine.scheduler.running))
                self._dispatch(outputs)
                if self._after_step is not None:
                    self._after_step(engine)
                self._stats = engine.stats()
                if not outputs and engine.last_num_scheduled == 0:
                    # Everything left waits on the outside (KV in flight, held blocks): sleep
                    # until a command arrives instead of spinning.
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except Exception as e:  # a broken step: fail everything in flight, loudly
            logger.exception("engine step failed; failing all in-flight requests")
            self.fatal_error = f"engine step failed: {type(e).__name__}: {e}"
            self._fail_all(self.fatal_error)
        finally:
            self._fail_pending_commands()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # handed to the caller, the loop keeps going
                fut.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is None:
                continue
            try:
                sink(out)
            except Exception:
                logger.exception("output sink of request %s failed; aborting it", out.request_id)
                self.engine.abort_request(out.request_id)
                self._sinks.pop(out.request_id, None)

    def _fail_all(self, message: str) -> None:
        for rid, sink in list(self._sinks.items()):
            try:
                sink(RequestOutput(rid, [], "", True, "error", error=message))
            except Exception:
                logger.exception("failing request %s", rid)
        self._sinks.clear()

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(self.fatal_error or "engine loop stopped"))
