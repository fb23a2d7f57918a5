"""The numbers each pool replica reports to Ray Serve's autoscaler (``record_autoscaling_stats``).

Ray Serve calls a replica's ``record_autoscaling_stats()`` periodically, keeps the values over
``look_back_period_s`` and hands their time-weighted mean per replica to the deployment's
autoscaling policy (``AutoscalingContext.aggregated_metrics``). The key names live here, beside
both of their users: the replicas' reports (``serving.replica``, from each pool's stats) and the
policies (``serving.autoscaling``). Every key carries a ``pd_`` prefix so none collides with
Ray's own ``running_requests`` series in the same report.

A latency key (TTFT, TPOT) is present only while its window holds samples: no recent requests
means no latency signal, not a latency of zero.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Any

# Both pools
RUNNING = "pd_running"  # sequences in the engine's batch
WAITING = "pd_waiting"  # sequences queued in the engine (incl. waiting for blocks or KV)
KV_USAGE = "pd_kv_usage"  # fraction of the replica's KV blocks in use (0..1)
# Prefill pool
QUEUED_PREFILL_TOKENS = "pd_queued_prefill_tokens"  # prompt tokens still to compute
ACTIVE_LEASES = "pd_active_leases"  # prefilled KV held until the decode side pulls it
TTFT_MS = "pd_ttft_ms"  # recent median time to first token on this replica (queue + prefill)
# Decode pool
MAX_NUM_SEQS = "pd_max_num_seqs"  # the replica's batch size limit
TPOT_MS = "pd_tpot_ms"  # recent median time per output token after the first


class RecentWindow:
    """Latency samples (ms) of the last ``window_s`` seconds; thread-safe, bounded."""

    def __init__(self, window_s: float, max_samples: int = 1024) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, value_ms: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, value_ms))

    def median(self, now: float | None = None) -> float | None:
        """The median of the samples still in the window; None when there are none."""
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        with self._lock:
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
            values = [v for _, v in self._samples]
        return statistics.median(values) if values else None


def prefill_autoscaling_stats(stats: dict[str, Any]) -> dict[str, float]:
    """A prefill replica's report, from its server's ``stats()``."""
    eng = stats.get("engine", {})
    out = {
        QUEUED_PREFILL_TOKENS: float(eng.get("num_queued_prefill_tokens", 0)),
        RUNNING: float(eng.get("num_running", 0)),
        WAITING: float(eng.get("num_waiting", 0)),
        ACTIVE_LEASES: float(stats.get("num_active_leases", 0)),
        KV_USAGE: float(eng.get("kv", {}).get("usage", 0.0)),
    }
    if stats.get("recent_ttft_ms") is not None:
        out[TTFT_MS] = float(stats["recent_ttft_ms"])
    return out


def decode_autoscaling_stats(stats: dict[str, Any], max_num_seqs: int) -> dict[str, float]:
    """A decode replica's report, from its server's ``stats()``."""
    eng = stats.get("engine", {})
    out = {
        KV_USAGE: float(eng.get("kv", {}).get("usage", 0.0)),
        RUNNING: float(eng.get("num_running", 0)),
        WAITING: float(eng.get("num_waiting", 0) + eng.get("num_waiting_for_kv", 0)),
        MAX_NUM_SEQS: float(max_num_seqs),
    }
    if stats.get("recent_tpot_ms") is not None:
        out[TPOT_MS] = float(stats["recent_tpot_ms"])
    return out
