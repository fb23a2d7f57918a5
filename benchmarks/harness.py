"""Shared benchmark plumbing: modes, progress, the human table, RESULT line and JSON file.

Every benchmark is a ratio of arms measured side by side in one run (docs/benchmarks/index.md). A
benchmark module exposes ``run(ctx: BenchContext) -> BenchReport``; this module prints and saves.
``ArmRun`` is what an engine benchmark records about one arm's run.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.planner.metrics import summary
from cluster.planner.workload import percentile

__all__ = ["MODES", "ArmRun", "BenchContext", "BenchReport", "emit", "percentile", "summary"]

RESULTS_DIR = Path("bench/results")
MODES = ("full", "quick", "smoke")


@dataclass
class BenchContext:
    name: str
    mode: str  # full | quick | smoke
    config: ClusterConfig
    results_dir: Path = RESULTS_DIR
    started: float = field(default_factory=time.monotonic)

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"

    @property
    def quick(self) -> bool:
        return self.mode == "quick"

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        """The size for this mode: ``ctx.pick(64, 16, 4)``."""
        return {"full": full, "quick": quick, "smoke": smoke}[self.mode]

    def progress(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{self.name} {elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class ArmRun:
    """One arm's run, one of an interleaved pair: what the engine benchmarks record about an
    arm, each filling the figures it compares (``workloads.run_pair`` runs a pair again when
    ``cpu_util`` shows that other work took cores)."""

    arm: str = ""
    cpu_util: float = 1.0  # < MIN_CPU_UTIL: other work on the machine took cores during this arm
    duration_s: float = 0.0  # first request in to last token out
    tokens: dict[str, list[int]] = field(default_factory=dict)  # per request: its output ids
    e2el_s: list[float] = field(default_factory=list)  # per request: arrival to last token
    ttft_s: list[float] = field(default_factory=list)  # per request: arrival to first token
    tpot_s: list[float] = field(default_factory=list)  # per request: per token after the first
    itl_s: list[float] = field(default_factory=list)  # gaps between a request's tokens, pooled
    step_s: list[float] = field(default_factory=list)  # steps in which a whole group decoded
    decode_tokens: int = 0  # tokens after each group's first token (batch 1: each request's)
    decode_s: float = 0.0  # the time they took
    total_tokens: int = 0  # every token, and the time from the groups' sends to their last
    total_s: float = 0.0
    drafted: int = 0  # speculative decoding: draft tokens proposed and accepted
    accepted: int = 0
    row_cost: float = float("nan")  # the speculator's draft-row cost at the arm's end
    num_preemptions: int = 0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")

    @property
    def e2e_tok_s(self) -> float:
        return self.total_tokens / self.total_s if self.total_s else float("nan")

    @property
    def step_ms(self) -> float:
        return 1e3 * statistics.median(self.step_s) if self.step_s else float("nan")

    def tok_s(self, num_tokens: int) -> float:
        """``num_tokens`` over the arm's duration."""
        return num_tokens / self.duration_s


@dataclass
class BenchReport:
    keys: dict[str, float]  # the RESULT line: ratios with targets
    table: list[dict[str, Any]] = field(default_factory=list)  # rows of the human table
    details: dict[str, Any] = field(default_factory=dict)  # everything else, into the JSON
    targets: dict[str, str] = field(default_factory=dict)  # key -> ">= 2.5" (shown, not enforced)
    files: list[str] = field(default_factory=list)  # extra artefacts written (PNG...)


def interleaved_order(arms: Sequence[str], rep: int) -> tuple[str, ...]:
    """Repetition ``rep``'s order of interleaved ``arms``: a permutation drawn with ``rep`` as
    its seed (so a run repeats), each arm following every other about equally often. Rotating
    one fixed order instead puts each arm always right after the same one, and what that one
    leaves behind (a cache it warmed, a process still finishing) biases the arm: in P4, the
    int8 pull always after the int8 shm pull that had written its destination blocks."""
    return tuple(random.Random(rep).sample(list(arms), len(arms)))


def child_env(root: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child that imports ``cluster`` from ``root``: ``root``
    first on ``PYTHONPATH``, the caller's own entries kept after it (packages installed on a
    path, as on a machine without a virtual environment, stay importable)."""
    paths = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(paths))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def emit(ctx: BenchContext, report: BenchReport) -> None:
    """Print the table and write JSON; the RESULT line is the very last line on stdout."""
    if report.table:
        cols = list(dict.fromkeys(k for row in report.table for k in row))
        widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in report.table)) for c in cols}
        print("  ".join(c.ljust(widths[c]) for c in cols))
        for row in report.table:
            print("  ".join(_fmt(row.get(c, "")).ljust(widths[c]) for c in cols))
    for key, value in report.keys.items():
        target = report.targets.get(key, "")
        print(f"  {key:32s} {_fmt(value):>10s}  {('target ' + target) if target else ''}")
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.results_dir / f"{ctx.name}.json"
    payload = {
        "name": ctx.name,
        "mode": ctx.mode,
        "keys": report.keys,
        "targets": report.targets,
        "table": report.table,
        "details": report.details,
        "files": report.files,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            # Other work on a shared machine shows here: read a noisy run's figures with it.
            "loadavg_1_5_15_at_end": os.getloadavg(),
        },
        "wall_s": time.monotonic() - ctx.started,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}", file=sys.stderr)
    print(
        f"RESULT {ctx.name} " + " ".join(f"{k}={_fmt(v)}" for k, v in report.keys.items()),
        flush=True,
    )
