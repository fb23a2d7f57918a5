"""``pdserve bench <name>``: the performance benchmarks P1-P11 of BENCHMARKS.md.

Each entry of ``BENCHMARKS`` names a module with ``run(ctx) -> BenchReport``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from cluster.bench.harness import MODES, BenchContext, emit
from cluster.config import ClusterConfig

# name -> module (imported on demand: each pulls its own heavy dependencies)
BENCHMARKS: dict[str, str] = {
    "engine": "cluster.bench.engine_batching",
    "decode-scaling": "cluster.bench.decode_scaling",
    "prefix": "cluster.bench.prefix_cache",
    "chunked-prefill": "cluster.bench.chunked_prefill",
    "kv-transfer": "cluster.bench.kv_transfer",
    "kv-stream": "cluster.bench.kv_stream",
    "serve": "cluster.bench.serve",
    "routing": "cluster.bench.routing",
    "quant": "cluster.bench.quant",
    "spec": "cluster.bench.spec",
    "structured": "cluster.bench.structured",
    "gpu": "cluster.bench.gpu",
}
# Only where a device is lent: left out of ``all`` on a machine without CUDA.
DEVICE_ONLY = frozenset({"gpu"})


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def run_benchmark(
    name: str, mode: str, config: ClusterConfig, results_dir: Path | None = None
) -> int:
    """Run one benchmark (or ``all``); JSON goes to ``results_dir`` (default bench/results)."""
    if mode not in MODES:
        raise ValueError(f"mode: unknown {mode!r}; valid: {', '.join(MODES)}")
    names = (
        [n for n in BENCHMARKS if n not in DEVICE_ONLY or _has_cuda()] if name == "all" else [name]
    )
    for n in names:
        if n not in BENCHMARKS:
            raise ValueError(
                f"benchmark: unknown name {n!r}; valid: {', '.join(sorted(BENCHMARKS))}, all"
            )
    for n in names:
        module = importlib.import_module(BENCHMARKS[n])
        ctx = BenchContext(name=n, mode=mode, config=config)
        if results_dir is not None:
            ctx.results_dir = results_dir
        emit(ctx, module.run(ctx))
    return 0
