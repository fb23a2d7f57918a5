"""The machine's core time from ``/proc/stat``: what every process used, and what a hypervisor
took (a measurement from a stretch with much of either says more about the neighbours than
about the code)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_CLOCK_TICKS = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _cpu_ticks() -> list[int] | None:
    """``/proc/stat``'s machine-wide line: user nice system idle iowait irq softirq steal."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return [int(v) for v in fields[1:9]]


def machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has used since boot (``/proc/stat``: all but
    idle and iowait, steal included: a hypervisor's share is taken from us too); None where
    there is no ``/proc/stat``."""
    ticks = _cpu_ticks()
    return None if ticks is None else (sum(ticks) - ticks[3] - ticks[4]) / _CLOCK_TICKS


def machine_steal_s() -> float | None:
    """CPU seconds a hypervisor has taken from this (virtual) machine's cores since boot: time
    a core had work but ran another guest (``/proc/stat``'s steal); None where unknown."""
    ticks = _cpu_ticks()
    return None if ticks is None else ticks[7] / _CLOCK_TICKS


class StealMeter:
    """The share of this machine's core time its hypervisor took over a stretch of wall time
    (0: none; a benchmark's figures from a stretch with much of it say more about the host's
    neighbours than about the code). None where ``/proc/stat`` has no steal."""

    def __init__(
        self,
        *,
        num_cores: int | None = None,
        steal: Callable[[], float | None] = machine_steal_s,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.num_cores = num_cores if num_cores is not None else (os.cpu_count() or 1)
        self._steal_fn, self._clock = steal, clock
        self._wall, self._steal = clock(), steal()

    def share(self) -> float | None:
        wall, now = self._clock() - self._wall, self._steal_fn()
        if now is None or self._steal is None or wall <= 0:
            return None
        return max(0.0, now - self._steal) / (wall * self.num_cores)
