"""P1 ``serve``: disaggregation under load, against the running cluster over gRPC.

How (docs/benchmarks/index.md, P1; docs/benchmarks/index.md has the notes; the arms and their
measuring are ``cluster.planner.measure``'s, which ``pdserve profile`` and ``plan --validate``
use too):
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

from pathlib import Path

from benchmarks.harness import BenchContext, BenchReport
from benchmarks.workloads import bench_model_dir
from cluster.config.model_paths import model_limits
from cluster.planner.measure.arms import (
    ARMS,
    ATTAINMENT,
    ArmRecords,
    arm_config,
    class_slos,
    measure,
)
from cluster.planner.measure.deploy import local_apps
from cluster.planner.measure.load import compute_metrics
from cluster.planner.metrics import knee
from cluster.planner.workload import MIXED_LONG


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


def _report(ctx: BenchContext, runs: ArmRecords) -> BenchReport:
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


def _plot(ctx: BenchContext, runs: ArmRecords, rate: float) -> list[str]:
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
