"""``pdserve bench <name>``: the performance benchmarks P1-P11 of docs/benchmarks/index.md.

A distribution of its own (``pdserve-benchmarks``, not in pdserve's wheel), installed beside
pdserve by ``make setup`` (``pip install -e ./benchmarks``). Each entry of ``BENCHMARKS`` names
a module with ``run(ctx) -> BenchReport``. What ``pdserve profile`` and ``pdserve plan
--validate`` measure is the product's (``cluster.planner.measure``); ``bench serve`` shares it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from benchmarks.harness import MODES, BenchContext, emit
from cluster.config import ClusterConfig

# name -> module (imported on demand: each pulls its own heavy dependencies)
BENCHMARKS: dict[str, str] = {
    "engine": "benchmarks.engine_batching",
    "decode-scaling": "benchmarks.decode_scaling",
    "prefix": "benchmarks.prefix_cache",
    "chunked-prefill": "benchmarks.chunked_prefill",
    "kv-transfer": "benchmarks.kv_transfer",
    "kv-stream": "benchmarks.kv_stream",
    "serve": "benchmarks.serve",
    "routing": "benchmarks.routing",
    "quant": "benchmarks.quant",
    "spec": "benchmarks.spec",
    "structured": "benchmarks.structured",
    "gpu": "benchmarks.gpu",
    "anchor-serve": "benchmarks.anchor_serve",
    "models": "benchmarks.models",
    "parallel": "benchmarks.parallel",
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
