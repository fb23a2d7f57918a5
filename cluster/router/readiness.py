"""Readiness: the router reports SERVING only while both pools can take a request (F22).

A probe loop on the router's event loop asks the decode pool ``ready()`` every
``router.readiness_period_s`` (a decode replica answers True when its engine and KV side are
alive and, with a prefill pool, that pool answers too); the state is cached, so ``/health`` and
the gRPC health service answer at once. Output streamed to a client is evidence as good as a
probe: while requests make progress the loop skips the probe (a saturated pool would queue it
behind the requests it is busy with, and a loaded cluster must not flap to NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Readiness:
    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]],
        *,
        period_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._clock = clock
        self.ready = False
        self.reason = "starting: the decode pool has not answered yet"
        self._last_progress = float("-inf")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def saw_progress(self) -> None:
        """A request streamed output: the pools it went through can take requests."""
        self._last_progress = self._clock()

    async def check(self) -> None:
        """One round: progress seen within the last period, or a probe answered True."""
        if self._clock() - self._last_progress < 2 * self.period_s:
            self._set(True, "")
            return
        try:
            ok = bool(await asyncio.wait_for(self._probe(), self.timeout_s))
            why = "" if ok else "a pool replica is not ready (engine, KV side or prefill pool)"
        except asyncio.TimeoutError:
            ok, why = False, f"no decode replica answered within {self.timeout_s:g} s"
        except Exception as e:  # a dead replica, no replica at all
            ok, why = False, f"the decode pool is unavailable ({type(e).__name__})"
        self._set(ok, why)

    def _set(self, ok: bool, why: str) -> None:
        if ok != self.ready:
            logger.warning("readiness: %s", "SERVING" if ok else f"NOT_SERVING: {why}")
        self.ready, self.reason = ok, why

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # the loop must outlive any one round
                logger.exception("readiness check failed")
            await asyncio.sleep(self.period_s)
