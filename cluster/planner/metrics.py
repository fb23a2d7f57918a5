"""Client-side serving metrics over request records (the benchmark docs' definitions), shared by the
simulator's predictions and ``bench serve``'s measurements so both are read the same way.

A record needs ``ok``, ``cls``, ``ttft``, ``tpot`` (None for one output token), ``e2el`` and
``max_tokens``; goodput counts the requests meeting their class's SLO per second of the run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, Protocol

from cluster.planner.workload import SLOs, percentile


class Record(Protocol):
    cls: str
    max_tokens: int

    @property
    def ok(self) -> bool: ...
    @property
    def ttft(self) -> float: ...
    @property
    def tpot(self) -> float | None: ...
    @property
    def e2el(self) -> float: ...


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "n": float(len(values)),
    }


def slo_metrics(records: Sequence[Record], duration_s: float, slos: SLOs | None) -> dict[str, Any]:
    """Completed, goodput and attainment (with ``slos``), TTFT/TPOT/E2EL, overall and by class."""
    ok = [r for r in records if r.ok]
    good = sum(1 for r in ok if slos is not None and slos.meets(r.cls, r.ttft, r.tpot))
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "goodput": good / duration_s if duration_s > 0 and slos is not None else 0.0,
        "slo_attainment": good / len(records) if records and slos is not None else 0.0,
        "ttft_s": summary([r.ttft for r in ok]),
        "tpot_s": summary([t for r in ok if (t := r.tpot) is not None]),
        "e2el_s": summary([r.e2el for r in ok]),
        "by_class": {},
    }
    for cls in sorted({r.cls for r in records}):
        mine = [r for r in ok if r.cls == cls]
        out["by_class"][cls] = {
            "completed": len(mine),
            "ttft_s": summary([r.ttft for r in mine]),
            "tpot_s": summary([t for r in mine if (t := r.tpot) is not None]),
            "slo_attainment": (
                sum(1 for r in mine if slos.meets(r.cls, r.ttft, r.tpot))
                / sum(1 for r in records if r.cls == cls)
                if slos is not None
                else 0.0
            ),
        }
    return out


def unloaded_baseline(records: Sequence[Record]) -> dict[str, tuple[float, float]]:
    """Per class: (p50 TTFT, p50 TPOT) of requests sent one at a time."""
    out = {}
    for cls in sorted({r.cls for r in records}):
        mine = [r for r in records if r.cls == cls and r.ok]
        tpots = [t for r in mine if (t := r.tpot) is not None]
        out[cls] = (percentile([r.ttft for r in mine], 50), percentile(tpots, 50))
    return out


def knee(rates: Sequence[float], attainment: Sequence[float], target: float) -> float | None:
    """The highest rate up to which every rate met ``target`` attainment (None: not even the
    lowest)."""
    best = None
    for rate, att in sorted(zip(rates, attainment)):
        if att < target:
            break
        best = rate
    return best
