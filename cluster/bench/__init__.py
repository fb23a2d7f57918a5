"""``pdserve bench <name>``: the performance benchmarks P1-P11 of BENCHMARKS.md.

Each entry of ``BENCHMARKS`` names a module with ``run(ctx) -> BenchReport``.
"""

from __future__ import annotations

import importlib

from cluster.bench.harness import MODES, BenchContext, emit
from cluster.config import ClusterConfig

# name -> module (imported on demand: each pulls its own heavy dependencies)
BENCHMARKS: dict[str, str] = {
    "kv-transfer": "cluster.bench.kv_transfer",
}


def run_benchmark(name: str, mode: str, config: ClusterConfig) -> int:
    if mode not in MODES:
        raise ValueError(f"mode: unknown {mode!r}; valid: {', '.join(MODES)}")
    names = list(BENCHMARKS) if name == "all" else [name]
    for n in names:
        if n not in BENCHMARKS:
            raise ValueError(
                f"benchmark: unknown name {n!r}; valid: {', '.join(sorted(BENCHMARKS))}, all"
            )
    for n in names:
        module = importlib.import_module(BENCHMARKS[n])
        ctx = BenchContext(name=n, mode=mode, config=config)
        emit(ctx, module.run(ctx))
    return 0
