"""``pdserve profile``: measure this machine's step-cost profile for ``pdserve plan``.

What it measures (the file format is ``cluster.planner.profile``):
  1. Engine steps, per torch-thread count (CPU; on a GPU the one device), and KV pulls over
     each transport (``cluster.planner.measure.engine``).
  2. Serving (unless ``--no-serving``; skipped in ``--smoke``): a colocated and a 1P1D arm on
     a local Ray Serve cluster (``bench serve``'s arms, ``cluster.planner.measure.arms``), a
     few unloaded requests of each ``mixed-long`` class: what the stack adds around the engine
     (TTFT minus the engine's prefill, the engine's prefill inside a replica and the client's
     TPOT over the bare engine's). These are unloaded single requests, plus a burst of
     ``BURST`` short ones sent at once and a long prompt while they decode: what each decode
     step gains per concurrent stream, and how much a pool's steps slow while the other pool
     computes (``cluster.planner.calibration``). ``pdserve plan --validate`` checks the
     predictions under load.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cluster.config import ClusterConfig, cpu_count
from cluster.planner.calibration import BURST, burst_samples, calibrate, self_check, serving_samples
from cluster.planner.measure.engine import (
    Progress,
    grid,
    grid_engine,
    measure_steps,
    measure_transfer,
    model_dir,
    step_costs,
)
from cluster.planner.profile import Profile, ServingCost, StepCosts, TransferCost, steps_key


def measure_serving(
    config: ClusterConfig,
    mode: str,
    steps: dict[str, StepCosts],
    transfer: dict[str, TransferCost],
    bytes_per_block: int,
    progress: Progress,
) -> tuple[dict[str, ServingCost], dict[str, Any]]:
    """Unloaded requests on a local Ray Serve cluster, a colocated and a 1P1D arm."""
    from cluster.config.model_paths import model_limits
    from cluster.planner.measure.arms import arm_config, measure
    from cluster.planner.measure.deploy import local_apps
    from cluster.planner.workload import MIXED_LONG

    model = str(config.model.path)
    configs = {
        "local": arm_config(config, "colocated", 1400, model),
        "remote": arm_config(config, "disagg", 1400, model),
    }
    vocab = model_limits(configs["local"]).vocab_size
    with local_apps() as put:
        runs = measure(
            put,
            configs,
            MIXED_LONG,
            rates=[],
            per_rate=0,
            per_class=2 if mode == "quick" else 4,
            vocab=vocab,
            scale=1.0,
            progress=progress,
            burst=BURST,
        )
    serving: dict[str, ServingCost] = {}
    raw: dict[str, Any] = {}
    for kind, cfg in configs.items():
        serving[kind], raw[kind] = calibrate(
            kind,
            serving_samples(runs.unloaded[kind]),
            steps,
            cfg,
            transfer.get(cfg.transfer.transports[0]),
            bytes_per_block,
            [burst_samples(runs.burst[kind])] if kind in runs.burst else [],
        )
        progress(f"serving {kind}: {serving[kind]}")
    return serving, raw


def _engine_steps(
    config: ClusterConfig,
    points: dict[str, Any],
    threads: Sequence[int],
    cuda: bool,
    progress: Progress,
    tp_sizes: Sequence[int] = (1,),
) -> tuple[dict[str, StepCosts], dict[str, Any], Any]:
    """Per thread count and tensor-parallel size (ranks x threads within the cores; a GPU:
    the one device): the step-cost table, the raw points and the self-check under
    ``measured``; and the engine's KV layout."""
    steps: dict[str, StepCosts] = {}
    measured: dict[str, Any] = {}
    layout = None
    shapes = [(n, tp) for tp in tp_sizes for n in threads if tp == 1 or n * tp <= cpu_count()]
    for n, tp in shapes:
        progress(f"engine steps, {tp} rank(s) of {n} torch thread(s)")
        torch.set_num_threads(n)
        engine = grid_engine(config.replace({"model.tensor_parallel_size": tp}), n, points)
        layout = engine.runner.layout
        try:
            raw = measure_steps(engine, points, progress)
        finally:
            engine.close()
        costs = step_costs(raw, points)
        key = "device" if cuda else steps_key(n, tp)
        steps[key] = costs
        measured[f"steps_{key}"] = raw
        measured[f"self_check_{key}"] = self_check(costs, raw["mixed"])
        del engine
    assert layout is not None, "no thread count to profile"
    return steps, measured, layout


def _device(cuda: bool, mode: str) -> dict[str, Any]:
    return {
        "kind": "cuda" if cuda else "cpu",
        "name": torch.cuda.get_device_name(0)
        if cuda
        else platform.processor() or platform.machine(),
        "cores": cpu_count(),
        "platform": platform.platform(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": mode,
    }


def run_profile(
    config: ClusterConfig,
    mode: str,
    out: Path,
    threads: Sequence[int] | None = None,
    serving: bool = True,
    progress: Progress = lambda msg: print(msg, flush=True),
    tp_sizes: Sequence[int] = (1,),
) -> Profile:
    """Measure the profile (``mode``: full, quick or smoke) and write it to ``out``;
    ``tp_sizes``: the tensor-parallel sizes whose engines are measured too (CPU)."""
    points = grid(mode)
    config = config.replace({"model.path": str(model_dir(config, mode))})
    cuda = torch.cuda.is_available() and config.model.device != "cpu"
    if threads is None:
        threads = (1,) if cuda else tuple(sorted({1, min(2, cpu_count())}))
    measured: dict[str, Any] = {
        "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in points.items()}
    }
    tps = (1,) if cuda else tp_sizes  # (ranks on CUDA devices are not built)
    steps, per_threads, layout = _engine_steps(config, points, threads, cuda, progress, tps)
    measured.update(per_threads)
    transfer = measure_transfer(config, layout, progress, reps=points["reps"] + 1)
    serving_costs: dict[str, ServingCost] = {}
    if serving and mode != "smoke" and not cuda:
        serving_costs, measured["serving"] = measure_serving(
            config, mode, steps, transfer, layout.bytes_per_block, progress
        )
    profile = Profile(
        device=_device(cuda, mode),
        model={
            "name": layout.model,
            "dtype": layout.dtype,
            "block_size": layout.block_size,
            "bytes_per_block": layout.bytes_per_block,
        },
        steps=steps,
        transfer=transfer,
        serving=serving_costs,
        measured=measured,
    )
    profile.save(out)
    progress(f"wrote {out}")
    return profile
