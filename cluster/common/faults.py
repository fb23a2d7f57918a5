"""Deterministic fault points ("buggify") for fault tests (torch-free, shared by every role).

``testing.fault_points`` holds specs ``<name>[:n][=action]``: the n-th time (default the 1st) a
worker reaches the named point it performs the action:

  * ``kill`` (default): SIGKILL itself, as a crash would;
  * ``raise``: raise ``FaultInjected`` at the point;
  * ``hang``: block forever (a deadlocked or stuck worker);
  * ``pause``: block until a test calls ``release(name)`` (phase-precise cancel tests).

Production code calls ``fault_points.hit("p.mid_send_frame_k")`` at each named point; with no
spec for the name that is a dict lookup and a counter bump.

Test-only: workers build theirs with ``FaultPoints.from_config(config.testing)``, which outside
test mode (``testing.enabled: false``, the default) is inert: it holds no spec, so every hit
passes, and ``arm`` refuses with ``PermissionError``. The config already refuses
``testing.fault_points`` without ``testing.enabled``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.config import TestingConfig

ACTIONS = ("kill", "raise", "hang", "pause")


class FaultInjected(RuntimeError):
    """Raised by a fault point whose action is ``raise``."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    name: str
    nth: int = 1
    action: str = "kill"

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        spec, _, action = text.strip().partition("=")
        name, sep, nth_text = spec.partition(":")
        name = name.strip()
        where = f"testing.fault_points: {text!r}"
        if not name:
            raise ValueError(f"{where}: empty fault point name")
        nth = 1
        if sep:
            try:
                nth = int(nth_text)
            except ValueError:
                raise ValueError(f"{where}: n must be an integer >= 1") from None
            if nth < 1:
                raise ValueError(f"{where}: n must be an integer >= 1")
        action = action.strip() or "kill"
        if action not in ACTIONS:
            raise ValueError(f"{where}: unknown action {action!r}; valid: {', '.join(ACTIONS)}")
        return cls(name, nth, action)


class FaultPoints:
    """Counts hits per point name and performs the configured action when one is due.

    Thread-safe: points may be hit from several threads; counting is atomic, the action runs
    outside the lock (so a paused thread does not block others).

    Invariant: a disabled instance never holds a spec (the constructor and ``arm`` refuse one),
    so its ``hit`` is the same dict miss as an unarmed point's.
    """

    def __init__(self, specs: Iterable[str] = (), *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._specs: dict[str, list[FaultSpec]] = {}
        for text in specs:
            self._require_enabled()
            spec = FaultSpec.parse(text)
            self._specs.setdefault(spec.name, []).append(spec)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._released: dict[str, threading.Event] = {}
        self._paused: dict[str, threading.Event] = {}
        self._num_paused: dict[str, int] = {}

    @classmethod
    def from_config(cls, testing: TestingConfig) -> FaultPoints:
        """The worker's fault points: ``testing.fault_points``, armable only in test mode."""
        return cls(testing.fault_points, enabled=testing.enabled)

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise PermissionError(
                "fault points are test-only: set testing.enabled: true in the config to arm them"
            )

    def armed(self, name: str) -> bool:
        return name in self._specs

    def count(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def hit(self, name: str) -> None:
        specs = self._specs.get(name)
        if specs is None:
            return
        with self._lock:
            n = self._counts.get(name, 0) + 1
            self._counts[name] = n
        for spec in specs:
            if spec.nth == n:
                self._act(spec)

    async def hit_async(self, name: str) -> None:
        """``hit`` from asyncio code: a pause or hang blocks a worker thread, not the event loop
        (which must keep serving, e.g. the call that releases the pause)."""
        if name in self._specs:
            import asyncio

            await asyncio.to_thread(self.hit, name)

    def arm(self, text: str) -> None:
        """Arm ``<name>[=action]`` at run time for the point's next hit (tests: one phase at a
        time on a live replica). A later ``pause`` waits for a fresh ``release``.
        Outside test mode: ``PermissionError``."""
        self._require_enabled()
        spec = FaultSpec.parse(text)
        with self._lock:
            nth = self._counts.get(spec.name, 0) + 1
            self._specs.setdefault(spec.name, []).append(FaultSpec(spec.name, nth, spec.action))
            if spec.action == "pause" and not self._num_paused.get(spec.name):
                self._released[spec.name] = threading.Event()
                self._paused[spec.name] = threading.Event()

    def paused(self) -> list[str]:
        """The points where some thread is paused right now."""
        with self._lock:
            return sorted(name for name, n in self._num_paused.items() if n > 0)

    def release(self, name: str) -> None:
        """Let threads paused at ``name`` (now or later) continue."""
        self._event(self._released, name).set()

    def wait_paused(self, name: str, timeout: float | None = None) -> bool:
        """Block until some thread is paused at ``name`` (tests)."""
        return self._event(self._paused, name).wait(timeout)

    def _event(self, table: dict[str, threading.Event], name: str) -> threading.Event:
        with self._lock:
            return table.setdefault(name, threading.Event())

    def _act(self, spec: FaultSpec) -> None:
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is asynchronous on some kernels; never run past the point
        elif spec.action == "raise":
            raise FaultInjected(f"fault point {spec.name}:{spec.nth}")
        elif spec.action == "hang":
            while True:
                time.sleep(3600)
        else:  # pause
            released = self._event(self._released, spec.name)
            with self._lock:
                self._num_paused[spec.name] = self._num_paused.get(spec.name, 0) + 1
            self._event(self._paused, spec.name).set()
            try:
                released.wait()
            finally:
                with self._lock:
                    self._num_paused[spec.name] -= 1
