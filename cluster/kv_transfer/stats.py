"""Plain counters and histograms for the data plane (exported as metrics by the server cores).

Written by the sender's or receiver's own thread, read by any thread through ``snapshot()``.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import Any

# Seconds, 1 ms to 10 s in 1-2-5 steps: a short pull on one host to a long prompt's KV over a
# slow network.
TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = TIME_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {
            "buckets": [*self.buckets, float("inf")],
            "cumulative": cumulative,
            "sum": self.sum,
            "count": self.count,
        }


class TransferStats:
    """Counters (``inc``), counters by reason (``failed``, ``rejected``), gauges and histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._by_reason: dict[str, Counter[str]] = {"failures": Counter(), "rejected": Counter()}
        self._gauges: dict[str, float] = {}
        self._histograms: dict[str, Histogram] = {"transfer_time_s": Histogram()}

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def failed(self, reason: str) -> None:
        with self._lock:
            self._by_reason["failures"][reason] += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._by_reason["rejected"][reason] += 1

    def set_gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms.setdefault(name, Histogram()).observe(value)

    def get(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out.update(self._gauges)
            for kind, counter in self._by_reason.items():
                out[kind] = dict(counter)
                out[f"{kind}_total"] = sum(counter.values())
            for name, hist in self._histograms.items():
                out[name] = hist.snapshot()
            return out
