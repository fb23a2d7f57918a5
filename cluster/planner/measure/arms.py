"""The serving arms ``bench serve``, ``pdserve profile`` and ``pdserve plan --validate``
measure, deployed side by side on one local Ray Serve instance, and how they are measured.

Arms: ``disagg`` (1 prefill + 1 decode replica, 1 torch thread each, every prefill remote),
``colocated`` (one replica doing both, 2 threads, no chunking) and ``colocated_chunked`` (the
same with 128-token chunks). Equal total KV bytes per arm: ``disagg``'s two replicas get half
the blocks each. ``measure`` warms each arm up, then sends unloaded requests (one at a time,
arms interleaved per request), optionally a burst, then Poisson arrivals at each rate (arms
interleaved per rate, the order rotated at each rate, the same requests for every arm).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig
from cluster.config.model_paths import model_limits
from cluster.planner.measure.deploy import arm_ports
from cluster.planner.measure.load import RequestRecord, run_load
from cluster.planner.measure.machine import StealMeter
from cluster.planner.metrics import unloaded_baseline
from cluster.planner.workload import SLOs, WorkItem, WorkloadMix, poisson_offsets

ARMS: dict[str, dict[str, Any]] = {
    "disagg": {
        "prefill.num_replicas": 1,
        "decode.num_replicas": 1,
        "prefill.num_threads": 1,
        "decode.num_threads": 1,
        "decode.local_prefill_threshold": 0,
    },
    "colocated": {
        "prefill.num_replicas": 0,
        "decode.num_replicas": 1,
        "decode.num_threads": 2,
        "decode.scheduler": {
            "max_num_seqs": 64,
            "max_num_batched_tokens": 4096,
            "chunk_size": None,
        },
    },
    "colocated_chunked": {
        "prefill.num_replicas": 0,
        "decode.num_replicas": 1,
        "decode.num_threads": 2,
        "decode.scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "chunk_size": 128},
    },
}
# Per-class SLOs: TTFT <= 3x and TPOT <= 2x the class's unloaded p50 on the slowest arm; an
# arm's knee is the highest rate up to which every rate kept this attainment.
TTFT_SLO_X, TPOT_SLO_X, ATTAINMENT = 3.0, 2.0, 0.9
# The burst's long prompt is sent once every short one has streamed this many tokens: all of
# them then decode together for a few steps before it prefills. (A fixed 2.5 s was too early
# for the 1P1D arm: its one-thread prefill replica took the first short alone, then the other
# seven in one 2.4-3.3 s step, so the shorts never decoded together outside the long prefill.)
BURST_LONG_AFTER_TOKENS = 6


def arm_config(config: ClusterConfig, arm: str, total_blocks: int, model_path: str) -> Any:
    """One arm's config: equal total KV blocks over its replicas, CPUs for all arms at once."""
    spec = ARMS[arm]
    replicas = spec["prefill.num_replicas"] + spec["decode.num_replicas"]
    base: dict[str, Any] = {
        "model.path": model_path,
        "cache.num_blocks": total_blocks // replicas,
        # Every arm is deployed at once: logical CPUs that fit them all on 2 cores.
        "prefill.num_cpus": 0.25,
        "decode.num_cpus": 0.25,
        "router.num_cpus": 0.1,
    }
    if arm == "colocated":  # no chunking: one step must hold a whole prompt (4096 at most)
        own = config.replace({"model.path": model_path, "model.max_model_len": None})
        base["model.max_model_len"] = min(4096, model_limits(own).max_model_len)
    return config.replace({**base, **spec})


@dataclass
class ArmRecords:
    """What ``measure`` recorded: unloaded requests and one run per rate, for every arm."""

    rates: list[float]
    unloaded: dict[str, list[RequestRecord]] = field(default_factory=dict)
    # Short requests sent all at once, then one long prompt (the last record) while they decode.
    burst: dict[str, list[RequestRecord]] = field(default_factory=dict)
    # Per arm and rate: the share of the machine's core time its hypervisor took during that
    # loaded run (None: unknown). A shared VM's neighbours can make one run slower than the next.
    steal: dict[str, dict[float, float | None]] = field(default_factory=dict)
    baseline_steal: float | None = None  # the same, over the unloaded runs and the bursts
    loaded: dict[str, dict[float, tuple[list[RequestRecord], float]]] = field(default_factory=dict)


def unloaded_items(
    workload: WorkloadMix, per_class: int, vocab: int, scale: float, seed: int = 1
) -> list[WorkItem]:
    """``per_class`` requests of every class, for the unloaded baseline (or a warm-up)."""
    out: list[WorkItem] = []
    while any(sum(1 for i in out if i.cls == c.name) < per_class for c in workload.classes):
        for item in workload.items(16, vocab, seed=seed, scale=scale):
            if sum(1 for i in out if i.cls == item.cls) < per_class:
                out.append(item)
        seed += 1000
    return out


def burst_items(
    workload: WorkloadMix, num: int, vocab: int, scale: float, seed: int = 23
) -> tuple[list[WorkItem], list[float]]:
    """``num`` requests of the class with the shortest prompts, sent at once, and one of the
    class with the longest, sent as soon as they all decode (``run_load``'s
    ``last_after_tokens=BURST_LONG_AFTER_TOKENS``): it prefills while they decode. Their own
    seed: prompts no other run sends."""
    short = min(workload.classes, key=lambda c: c.prompt[1]).name
    long = max(workload.classes, key=lambda c: c.prompt[1]).name
    drawn = unloaded_items(workload, num, vocab, scale, seed=seed)
    items = [i for i in drawn if i.cls == short] + [next(i for i in drawn if i.cls == long)]
    return items, [0.0] * (num + 1)


@dataclass(frozen=True, slots=True)
class _Requests:
    """What ``measure`` sends: the workload's prompts at ``vocab`` and length ``scale``."""

    workload: WorkloadMix
    vocab: int
    scale: float


def _unloaded(
    targets: dict[str, str], req: _Requests, per_class: int, seed: int, runs: ArmRecords
) -> None:
    """One request at a time (no queueing, no batching), the arms interleaved per request."""
    items = unloaded_items(req.workload, per_class, req.vocab, req.scale, seed=seed)
    for arm in targets:
        runs.unloaded[arm] = []
    for item in items:
        for arm, target in targets.items():
            recs, _ = asyncio.run(run_load(target, [item], [0.0]))
            runs.unloaded[arm].extend(recs)


def _bursts(
    targets: dict[str, str], req: _Requests, burst: int, seed: int, runs: ArmRecords
) -> None:
    load, offsets = burst_items(req.workload, burst, req.vocab, req.scale, seed=seed)
    for arm, target in targets.items():
        runs.burst[arm], _ = asyncio.run(
            run_load(target, load, offsets, last_after_tokens=BURST_LONG_AFTER_TOKENS)
        )


def _loaded(
    targets: dict[str, str],
    req: _Requests,
    per_rate: int,
    seed: int,
    runs: ArmRecords,
    progress: Callable[[str], None],
) -> None:
    """Poisson arrivals at each rate, the arms interleaved (the order rotated at each rate)."""
    arms = list(targets)
    for i, rate in enumerate(runs.rates):
        load = req.workload.items(per_rate, req.vocab, seed=seed + i, scale=req.scale)
        offsets = poisson_offsets(per_rate, rate, seed=seed + 100 + i)
        for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
            progress(f"{arm}: {per_rate} requests at {rate} req/s")
            meter = StealMeter()
            runs.loaded.setdefault(arm, {})[rate] = asyncio.run(
                run_load(targets[arm], load, offsets)
            )
            runs.steal.setdefault(arm, {})[rate] = stolen = meter.share()
            if stolen:
                progress(f"{arm}: the hypervisor took {100 * stolen:.1f}% of the cores' time")


def measure(
    put: Callable[[str, Any], None],
    configs: dict[str, Any],
    workload: WorkloadMix,
    rates: Sequence[float],
    per_rate: int,
    per_class: int,
    vocab: int,
    scale: float,
    progress: Callable[[str], None],
    deploy: bool = True,
    seed: int = 100,
    burst: int = 0,
    sample_seed: int = 0,
) -> ArmRecords:
    """Deploy the arms side by side, warm each up, then unloaded and loaded runs, interleaved.
    ``burst``: after the unloaded runs, that many requests of the workload's shortest class sent
    to each arm at once, and a long prompt while they decode (the planner's calibration of the
    stack's cost per streamed token and of the pools' contention: ``burst_items``).

    The requests at the i-th rate are ``workload.items(per_rate, seed=seed + i)``, sent at
    ``poisson_offsets(per_rate, rate, seed + 100 + i)``. A caller measuring several workloads on
    the same deployment gives each its own ``seed``: the same seed draws the same prompts from
    workloads whose class picks coincide, and the second would hit the first one's prefix cache.
    For the same reason, a caller that takes unloaded requests or a burst on an arm more than
    once gives each time its own small ``sample_seed`` (0, 2, 4, ...: it shifts those prompts'
    seeds, which sit apart from the loaded runs')."""
    configs = arm_ports(configs)
    targets = {arm: f"127.0.0.1:{cfg.router.grpc_port}" for arm, cfg in configs.items()}
    if deploy:
        for arm, cfg in configs.items():
            progress(f"deploying arm {arm}")
            put(arm, cfg)
    req = _Requests(workload, vocab, scale)
    warm = unloaded_items(workload, 1, vocab, scale, seed=7)
    # First calls, lazy inits: not measured (prompts used nowhere else).
    for target in targets.values():
        for item in warm:
            asyncio.run(run_load(target, [item], [0.0]))
    runs = ArmRecords(list(rates))
    meter = StealMeter()
    _unloaded(targets, req, per_class, 1 + sample_seed, runs)
    progress("unloaded baseline done")
    if burst:
        _bursts(targets, req, burst, 23 + sample_seed, runs)
        progress(f"bursts of {burst} done")
    runs.baseline_steal = meter.share()
    _loaded(targets, req, per_rate, seed, runs, progress)
    return runs


def class_slos(unloaded: dict[str, list[RequestRecord]]) -> SLOs:
    """Per class: TTFT_SLO_X / TPOT_SLO_X x the class's unloaded p50 on the slowest arm."""
    base = {arm: unloaded_baseline(recs) for arm, recs in unloaded.items()}
    classes = sorted({c for b in base.values() for c in b})
    return SLOs.from_unloaded(
        {
            c: (max(b[c][0] for b in base.values()), max(b[c][1] for b in base.values()))
            for c in classes
        },
        TTFT_SLO_X,
        TPOT_SLO_X,
    )
