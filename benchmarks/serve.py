"""P1 ``serve``: disaggregation under load, against the running cluster over gRPC.

How (BENCHMARKS.md, P1; the README's benchmarks section has the notes):
  * Arms, deployed side by side as applications of one local Ray/Serve instance (each arm's
    router on its own gRPC port; an idle arm's replicas only poll): ``disagg`` (1 prefill
    + 1 decode replica, 1 torch thread each, every prefill remote), ``colocated`` (one replica
    doing both, 2 threads, no chunking) and ``colocated_chunked`` (the same with 128-token
    chunks). Equal total KV bytes per arm: ``disagg``'s two replicas get half the blocks each.
  * Workload ``mixed-long``; warm-up (one request of each class per arm, prompts used nowhere
    else) is not measured. Unloaded: a few requests of each class, one at a time, arms
    interleaved per request. Then Poisson arrivals at a fixed list of rates, the arms
    interleaved per rate (the order rotated at each rate), the same requests for every arm.
  * SLOs per prompt-length class (chat, long): TTFT <= 3x and TPOT <= 2x the class's unloaded
    p50 on the slowest arm, so every arm can meet them unloaded and long prompts are held to a
    long prompt's figure.
  * Each arm's knee: the highest rate up to which every rate kept >= 90% attainment.
    ``knee_found`` is 1 when every arm has one; when one has none (not even the lowest rate met
    the attainment) its goodput at the lowest rate stands in, and the report names it.

Keys: ``goodput_ratio_vs_colocated`` and ``goodput_ratio_vs_chunked`` (goodput at each arm's own
knee), ``p99_tpot_ratio_vs_colocated`` (colocated / disagg p99 TPOT at the lower of the two
knees, a rate both sustain), ``knee_found``. On 2 shared cores a harness and a trend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchContext, BenchReport
from benchmarks.serve_load import (
    RequestRecord,
    arm_ports,
    compute_metrics,
    local_apps,
    poisson_offsets,
    run_load,
)
from benchmarks.workloads import StealMeter, bench_model_dir
from cluster.config import ClusterConfig
from cluster.config.model_paths import model_limits
from cluster.planner.metrics import knee, unloaded_baseline
from cluster.planner.workload import MIXED_LONG, SLOs, WorkItem, Workload

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
TTFT_SLO_X, TPOT_SLO_X, ATTAINMENT = 3.0, 2.0, 0.9


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
class ArmRuns:
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
    workload: Workload, per_class: int, vocab: int, scale: float, seed: int = 1
) -> list[WorkItem]:
    """``per_class`` requests of every class, for the unloaded baseline (or a warm-up)."""
    out: list[WorkItem] = []
    while any(sum(1 for i in out if i.cls == c.name) < per_class for c in workload.classes):
        for item in workload.items(16, vocab, seed=seed, scale=scale):
            if sum(1 for i in out if i.cls == item.cls) < per_class:
                out.append(item)
        seed += 1000
    return out


# The burst's long prompt is sent once every short one has streamed this many tokens: all of
# them then decode together for a few steps before it prefills. (A fixed 2.5 s was too early
# for the 1P1D arm: its one-thread prefill replica took the first short alone, then the other
# seven in one 2.4-3.3 s step, so the shorts never decoded together outside the long prefill.)
BURST_LONG_AFTER_TOKENS = 6


def burst_items(
    workload: Workload, num: int, vocab: int, scale: float, seed: int = 23
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


def measure(
    put: Callable[[str, Any], None],
    configs: dict[str, Any],
    workload: Workload,
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
) -> ArmRuns:
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
    arms = list(configs)
    if deploy:
        for arm, cfg in configs.items():
            progress(f"deploying arm {arm}")
            put(arm, cfg)
    warm = unloaded_items(workload, 1, vocab, scale, seed=7)
    for arm in arms:  # first calls, lazy inits: not measured (prompts used nowhere else)
        for item in warm:
            asyncio.run(run_load(targets[arm], [item], [0.0]))
    runs = ArmRuns(list(rates))
    meter = StealMeter()
    items = unloaded_items(workload, per_class, vocab, scale, seed=1 + sample_seed)
    for arm in arms:
        runs.unloaded[arm] = []
    for item in items:  # one at a time: no queueing, no batching; arms interleaved
        for arm in arms:
            recs, _ = asyncio.run(run_load(targets[arm], [item], [0.0]))
            runs.unloaded[arm].extend(recs)
    progress("unloaded baseline done")
    if burst:
        burst_load, burst_offsets = burst_items(
            workload, burst, vocab, scale, seed=23 + sample_seed
        )
        for arm in arms:
            runs.burst[arm], _ = asyncio.run(
                run_load(
                    targets[arm],
                    burst_load,
                    burst_offsets,
                    last_after_tokens=BURST_LONG_AFTER_TOKENS,
                )
            )
        progress(f"bursts of {burst} done")
    runs.baseline_steal = meter.share()
    for i, rate in enumerate(rates):
        load = workload.items(per_rate, vocab, seed=seed + i, scale=scale)
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


def run(ctx: BenchContext) -> BenchReport:

    rates = ctx.pick([0.25, 0.5, 1.0, 1.5, 2.0], [0.25, 0.75], [2.0])
    total_blocks = ctx.pick(1400, 1400, 256)
    model = str(bench_model_dir(ctx))
    configs = {arm: arm_config(ctx.config, arm, total_blocks, model) for arm in ARMS}
    first = configs["disagg"]
    vocab = model_limits(first).vocab_size
    with local_apps() as put:
        runs = measure(
            put,
            configs,
            MIXED_LONG,
            rates,
            per_rate=ctx.pick(200, 20, 6),
            per_class=ctx.pick(4, 2, 1),
            vocab=vocab,
            scale=ctx.pick(1.0, 1.0, 0.05),
            progress=ctx.progress,
        )
    return _report(ctx, runs)


def _report(ctx: BenchContext, runs: ArmRuns) -> BenchReport:
    slos = class_slos(runs.unloaded)
    metrics = {
        arm: {rate: compute_metrics(recs, dur, slos=slos) for rate, (recs, dur) in by_rate.items()}
        for arm, by_rate in runs.loaded.items()
    }
    rates = runs.rates
    knees = {
        arm: knee(rates, [m[r]["slo_attainment"] for r in rates], ATTAINMENT)
        for arm, m in metrics.items()
    }
    missing = [arm for arm, k in knees.items() if k is None]
    for arm in missing:
        att = metrics[arm][rates[0]]["slo_attainment"]
        ctx.progress(
            f"no knee for {arm}: {100 * att:.0f}% SLO attainment at the lowest rate "
            f"({rates[0]} req/s), under {100 * ATTAINMENT:.0f}%; its goodput there stands in"
        )
    at = {arm: metrics[arm][k if k is not None else rates[0]] for arm, k in knees.items()}
    common = min((knees[a] or rates[0]) for a in ("disagg", "colocated"))

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("inf") if a > 0 else 1.0

    keys = {
        "goodput_ratio_vs_colocated": ratio(at["disagg"]["goodput"], at["colocated"]["goodput"]),
        "p99_tpot_ratio_vs_colocated": ratio(
            metrics["colocated"][common]["tpot_s"]["p99"],
            metrics["disagg"][common]["tpot_s"]["p99"],
        ),
        "goodput_ratio_vs_chunked": ratio(
            at["disagg"]["goodput"], at["colocated_chunked"]["goodput"]
        ),
        "knee_found": 0.0 if missing else 1.0,
    }
    table = []
    for arm, by_rate in metrics.items():
        for rate, m in by_rate.items():
            table.append(
                {
                    "arm": arm,
                    "rate": rate,
                    "knee": "*" if rate == knees[arm] else "",
                    "done": m["completed"],
                    "failed": m["failed"],
                    "goodput": m["goodput"],
                    "slo_%": 100 * m["slo_attainment"],
                    "ttft_p50": m["ttft_s"]["p50"],
                    "ttft_p99": m["ttft_s"]["p99"],
                    "tpot_p50": m["tpot_s"]["p50"],
                    "tpot_p99": m["tpot_s"]["p99"],
                    "itl_p99": m["itl_s"]["p99"],
                }
            )
    files = _plot(ctx, runs, common)
    return BenchReport(
        keys=keys,
        table=table,
        details={
            "knee_rate": knees,
            "no_knee": missing,
            "p99_tpot_rate": common,
            "slos": slos.to_dict(),
            "unloaded": {a: compute_metrics(r, 1.0) for a, r in runs.unloaded.items()},
            "metrics": {a: {str(r): m for r, m in bm.items()} for a, bm in metrics.items()},
        },
        targets={
            "goodput_ratio_vs_colocated": ">= 2 (real hardware)",
            "p99_tpot_ratio_vs_colocated": "> 1 (trend)",
            "goodput_ratio_vs_chunked": ">= 1.0 (real hardware)",
            "knee_found": "1 (every arm had a knee)",
        },
        files=files,
    )


def _plot(ctx: BenchContext, runs: ArmRuns, rate: float) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arm, by_rate in runs.loaded.items():
        recs = [r for r in by_rate[rate][0] if r.ok]
        for ax, values, label in (
            (axes[0], [r.ttft for r in recs], "TTFT (s)"),
            (axes[1], [t for r in recs if (t := r.tpot) is not None], "TPOT (s)"),
            (axes[2], [g for r in recs for g in r.itls], "ITL (s)"),
        ):
            xs = sorted(values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=arm)
            ax.set_xlabel(label)
            ax.set_ylabel("CDF")
    axes[0].legend()
    fig.suptitle(f"P1 serve: latency CDFs at {rate} req/s")
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    path = Path(ctx.results_dir) / "serve_latency_cdf.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [str(path)]
