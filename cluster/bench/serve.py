"""P1 ``serve``: disaggregation under load, against the running cluster over gRPC.

Arms, one after the other on the same local Ray/Serve instance: ``disagg`` (1 prefill + 1
decode replica, 1 torch thread each), ``colocated`` (one replica doing both, 2 threads, no
chunking) and ``colocated_chunked`` (the same with 128-token chunks). Workload ``mixed-long``,
Poisson arrivals at a fixed list of rates. SLOs are multiples of the unloaded TTFT and TPOT
measured in the same run (TTFT <= 3x, TPOT <= 2x, the slowest arm's unloaded figure); the knee
is the highest rate at which the disaggregated arm keeps >= 90% SLO attainment, and the keys
compare the arms there. On 2 shared cores this is a harness and a trend, not a verdict.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cluster.bench.harness import BenchContext, BenchReport
from cluster.bench.serve_load import (
    RequestRecord,
    WorkItem,
    compute_metrics,
    local_cluster,
    mixed_long,
    poisson_offsets,
    run_load,
)
from cluster.bench.workloads import bench_model_dir

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


def _arm_config(ctx: BenchContext, arm: str) -> Any:
    base = {"model.path": str(bench_model_dir(ctx)), "cache.num_blocks": ctx.pick(1400, 1400, 256)}
    if arm == "colocated":  # no chunking: one step must hold a whole prompt
        base["model.max_model_len"] = ctx.pick(4096, 4096, 1024)
    return ctx.config.replace({**base, **ARMS[arm]})


def _unloaded(target: str, items: list[WorkItem]) -> list[RequestRecord]:
    recs: list[RequestRecord] = []
    for item in items:  # one at a time: no queueing, no batching
        got, _ = asyncio.run(run_load(target, [item], [0.0]))
        recs.extend(got)
    return recs


def run(ctx: BenchContext) -> BenchReport:
    from cluster.config.model_paths import model_limits

    rates = ctx.pick([0.25, 0.5, 1.0, 1.5, 2.0], [0.25, 0.75], [2.0])
    per_rate = ctx.pick(200, 20, 6)
    scale = ctx.pick(1.0, 1.0, 0.05)
    first = _arm_config(ctx, "disagg")
    vocab = model_limits(first).vocab_size
    target = f"127.0.0.1:{first.router.grpc_port}"
    unloaded_items = mixed_long(ctx.pick(6, 3, 2), vocab, seed=1, scale=scale)
    records: dict[str, dict[float, tuple[list[RequestRecord], float]]] = {}
    unloaded: dict[str, list[RequestRecord]] = {}
    with local_cluster() as put:
        for arm in ARMS:
            ctx.progress(f"deploying arm {arm}")
            put(_arm_config(ctx, arm))
            asyncio.run(run_load(target, unloaded_items[:1], [0.0]))  # warm-up
            unloaded[arm] = _unloaded(target, unloaded_items)
            records[arm] = {}
            for i, rate in enumerate(rates):
                items = mixed_long(per_rate, vocab, seed=100 + i, scale=scale)
                ctx.progress(f"{arm}: {per_rate} requests at {rate} req/s")
                records[arm][rate] = asyncio.run(
                    run_load(target, items, poisson_offsets(per_rate, rate, seed=200 + i))
                )
    return _report(ctx, rates, records, unloaded)


def _report(
    ctx: BenchContext,
    rates: list[float],
    records: dict[str, dict[float, tuple[list[RequestRecord], float]]],
    unloaded: dict[str, list[RequestRecord]],
) -> BenchReport:
    base = {arm: compute_metrics(recs, 1.0) for arm, recs in unloaded.items()}
    ttft_slo = TTFT_SLO_X * max(m["ttft_s"]["p50"] for m in base.values())
    tpot_slo = TPOT_SLO_X * max(m["tpot_s"]["p50"] for m in base.values())
    metrics = {
        arm: {
            rate: compute_metrics(recs, dur, ttft_slo, tpot_slo)
            for rate, (recs, dur) in by_rate.items()
        }
        for arm, by_rate in records.items()
    }
    ok_rates = [r for r in rates if metrics["disagg"][r]["slo_attainment"] >= ATTAINMENT]
    knee = max(ok_rates) if ok_rates else min(rates)
    table = []
    for arm, by_rate in metrics.items():
        for rate, m in by_rate.items():
            table.append(
                {
                    "arm": arm,
                    "rate": rate,
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

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("inf") if a > 0 else 1.0

    at = {arm: metrics[arm][knee] for arm in metrics}
    keys = {
        "goodput_ratio_vs_colocated": ratio(at["disagg"]["goodput"], at["colocated"]["goodput"]),
        "p99_tpot_ratio_vs_colocated": ratio(
            at["colocated"]["tpot_s"]["p99"], at["disagg"]["tpot_s"]["p99"]
        ),
        "goodput_ratio_vs_chunked": ratio(
            at["disagg"]["goodput"], at["colocated_chunked"]["goodput"]
        ),
    }
    files = _plot(ctx, records, knee)
    return BenchReport(
        keys=keys,
        table=table,
        details={
            "knee_rate": knee,
            "ttft_slo_s": ttft_slo,
            "tpot_slo_s": tpot_slo,
            "unloaded": base,
            "metrics": {a: {str(r): m for r, m in bm.items()} for a, bm in metrics.items()},
        },
        targets={
            "goodput_ratio_vs_colocated": ">= 2 (real hardware)",
            "p99_tpot_ratio_vs_colocated": "> 1 (trend)",
            "goodput_ratio_vs_chunked": ">= 1.0 (real hardware)",
        },
        files=files,
    )


def _plot(ctx: BenchContext, records: dict[str, Any], knee: float) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arm, by_rate in records.items():
        recs = [r for r in by_rate[knee][0] if r.ok]
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
    fig.suptitle(f"P1 serve: latency CDFs at {knee} req/s")
    ctx.results_dir.mkdir(parents=True, exist_ok=True)
    path = Path(ctx.results_dir) / "serve_latency_cdf.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [str(path)]
