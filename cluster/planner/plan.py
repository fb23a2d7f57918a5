"""``pdserve plan``: the best prefill/decode split of a device count, by simulation.

For ``devices`` N (a device is one accelerator, or on a CPU profile one core: one torch thread),
the candidate arms are every xPyD split (x prefill + y decode replicas, one device per rank),
``colocated`` (N replicas doing both, no chunking) and ``colocated_chunked`` (the same with
128-token chunks); on a CPU profile with a table for N threads also the one-replica forms
(``colocated_1xN``, ``colocated_chunked_1xN``), which is what ``bench serve`` runs on 2 cores.
Where the profile has step costs for tensor-parallel engines (``steps_key``: ``pdserve profile
--tp``), each pool's TP size is searched with the split: ``xPyD_tpPxQ`` runs x prefill
replicas of P ranks and y decode replicas of Q ranks (x P + y Q = N), and ``colocated_tpT``
N / T replicas of T ranks. A replica holds ``kv_blocks_per_device`` KV blocks per rank: every
colocated arm and every split's decode pool has the same total KV.

Each arm is simulated (``simulator.SimCluster``) on the workload:
  1. unloaded, one request at a time, to set the SLOs as ``bench serve`` does: per prompt-length
     class, ``ttft_x`` x and ``tpot_x`` x the p50 of the slowest arm (unless given);
  2. at ``rate`` (Poisson): goodput, SLO attainment, TTFT / TPOT percentiles;
  3. a rate sweep for its knee: the highest rate up to which attainment stays >= ``attainment``.
The best split is the xPyD arm with the highest knee (goodput under the SLOs), ties going to the
higher goodput at ``rate``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.planner.metrics import knee, slo_metrics, unloaded_baseline
from cluster.planner.profile import Profile
from cluster.planner.simulator import ArmSpec, SimCluster, SimRecord
from cluster.planner.workload import SLOs, WorkloadMix, poisson_offsets

ATTAINMENT = 0.9


@dataclass(frozen=True)
class PlanInput:
    profile: Profile
    workload: WorkloadMix
    rate: float  # requests/s the plan is evaluated at
    devices: int
    num_requests: int = 200
    ttft_x: float = 3.0
    tpot_x: float = 2.0
    slos: SLOs | None = None  # absolute, per class; None: multiples of the unloaded p50s
    kv_blocks_per_device: int = 700
    attainment: float = ATTAINMENT
    sweep_steps: int = 7
    vocab_size: int = 49152
    seed: int = 100

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices: must be >= 1, got {self.devices}")
        if self.rate <= 0 or not math.isfinite(self.rate):
            raise ValueError(f"rate: must be a positive number, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError("num_requests: must be >= 1")


@dataclass
class ArmResult:
    arm: ArmSpec
    at_rate: dict[str, Any]
    knee_rate: float | None
    sweep: list[tuple[float, float, float]] = field(default_factory=list)  # rate, att, goodput
    unloaded: dict[str, tuple[float, float]] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        m = self.at_rate
        return {
            "arm": self.arm.name,
            "P": self.arm.prefill,
            "D": self.arm.decode,
            "P_tp": self.arm.config.for_pool("prefill").model.tensor_parallel_size,
            "D_tp": self.arm.config.for_pool("decode").model.tensor_parallel_size,
            "goodput": m["goodput"],
            "slo_%": 100 * m["slo_attainment"],
            "ttft_p50": m["ttft_s"]["p50"],
            "ttft_p90": m["ttft_s"]["p90"],
            "ttft_p99": m["ttft_s"]["p99"],
            "tpot_p50": m["tpot_s"]["p50"],
            "tpot_p90": m["tpot_s"]["p90"],
            "tpot_p99": m["tpot_s"]["p99"],
            "knee_rate": self.knee_rate if self.knee_rate is not None else "none",
        }


@dataclass
class PlanResult:
    input: PlanInput
    slos: SLOs
    arms: list[ArmResult]
    best: ArmResult | None  # the best xPyD split (None when devices < 2)

    @property
    def best_overall(self) -> ArmResult:
        """The arm with the highest goodput under the SLOs, colocated ones included."""
        return max(self.arms, key=lambda r: (r.knee_rate or 0.0, r.at_rate["goodput"]))

    def tp_choice(self) -> str | None:
        """Why the best split has its tensor parallelism: its goodput against the best split
        of every other (prefill TP, decode TP) pair the profile allowed; None without a split."""
        if self.best is None:
            return None
        by_tp: dict[tuple[int, int], ArmResult] = {}
        for r in self.arms:
            if r.arm.colocated:
                continue
            key = _tps(r.arm)
            if key not in by_tp or _score(r) > _score(by_tp[key]):
                by_tp[key] = r
        p, d = _tps(self.best.arm)
        others = [
            f"{r.arm.name} {r.knee_rate or 0:.3g}" for k, r in sorted(by_tp.items()) if k != (p, d)
        ]
        why = f"prefill TP {p}, decode TP {d}: goodput {self.best.knee_rate or 0:.3g} req/s"
        if not others:
            return why + " (the profile has step costs for no other TP size)"
        return why + "; the best split at each other TP pair: " + ", ".join(others)

    def to_dict(self) -> dict[str, Any]:
        inp = self.input
        return {
            "devices": inp.devices,
            "rate": inp.rate,
            "workload": inp.workload.to_dict(),
            "slos": self.slos.to_dict(),
            "best_split": self.best.arm.name if self.best is not None else None,
            "tp_choice": self.tp_choice(),
            "best_overall": self.best_overall.arm.name,
            "arms": [
                {
                    **r.row(),
                    "metrics": r.at_rate,
                    "sweep": r.sweep,
                    "unloaded": r.unloaded,
                }
                for r in self.arms
            ],
            "device": inp.profile.device,
        }


def arms_for(
    devices: int, profile: Profile, kv_blocks_per_device: int, base: ClusterConfig | None = None
) -> list[ArmSpec]:
    """Every xPyD split of ``devices`` and the colocated alternatives, equal total KV."""
    base = base or ClusterConfig()
    total = kv_blocks_per_device * devices
    per_device = {
        "model.num_threads": 1,
        "prefill.num_threads": 1,
        "decode.num_threads": 1,
    }
    arms = []
    tps = profile.tensor_parallel_sizes(1) or [1]
    for p, d in ((p, d) for p in tps for d in tps):
        for x in range(1, devices):
            y, rest = divmod(devices - x * p, d)
            if y < 1 or rest:
                continue
            cfg = base.replace(
                {
                    **per_device,
                    # a replica of Q ranks holds Q devices' KV (a split's decode pool: all of it
                    # at Q = P = 1; the prefill pool's replicas get as many)
                    "cache.num_blocks": kv_blocks_per_device * d,
                    "decode.local_prefill_threshold": 0,
                    "prefill.tensor_parallel_size": p,
                    "decode.tensor_parallel_size": d,
                }
            )
            arms.append(ArmSpec(f"{x}P{y}D" + _tp_suffix(p, d), x, y, cfg))
    colocated = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "chunk_size": None}
    chunked = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "chunk_size": 128}
    for name, sched in (("colocated", colocated), ("colocated_chunked", chunked)):
        for tp in (t for t in tps if devices % t == 0):
            n = devices // tp
            cfg = base.replace(
                {
                    **per_device,
                    "cache.num_blocks": kv_blocks_per_device * tp,
                    "decode.scheduler": sched,
                    "decode.tensor_parallel_size": tp,
                }
            )
            arms.append(ArmSpec(name + (f"_tp{tp}" if tp > 1 else ""), 0, n, cfg))
        if devices > 1 and str(devices) in profile.steps:  # one replica on every core
            one = base.replace(
                {
                    "model.num_threads": devices,
                    "decode.num_threads": devices,
                    "cache.num_blocks": total,
                    "decode.scheduler": sched,
                }
            )
            arms.append(ArmSpec(f"{name}_1x{devices}", 0, 1, one))
    return arms


def _tps(arm: ArmSpec) -> tuple[int, int]:
    cfg = arm.config
    return (
        cfg.for_pool("prefill").model.tensor_parallel_size,
        cfg.for_pool("decode").model.tensor_parallel_size,
    )


def _score(r: ArmResult) -> tuple[float, float]:
    return (r.knee_rate or 0.0, r.at_rate["goodput"])


def _tp_suffix(prefill_tp: int, decode_tp: int) -> str:
    return "" if prefill_tp == decode_tp == 1 else f"_tp{prefill_tp}x{decode_tp}"


def simulate(
    arm: ArmSpec,
    profile: Profile,
    workload: WorkloadMix,
    rate: float,
    num: int,
    seed: int,
    vocab_size: int,
    scale: float = 1.0,
) -> tuple[list[SimRecord], float]:
    """The arm under ``num`` Poisson arrivals at ``rate`` (the seeds ``bench serve`` uses)."""
    items = workload.items(num, vocab_size, seed=seed, scale=scale)
    offsets = poisson_offsets(num, rate, seed=seed + 100)
    records = SimCluster(arm, profile).run(items, offsets)
    return records, _duration(records)


def simulate_unloaded(
    arm: ArmSpec, profile: Profile, items: Sequence[Any], gap_s: float = 1e4
) -> list[SimRecord]:
    """Each request alone: arrivals far apart, so nothing queues or batches."""
    return SimCluster(arm, profile).run(items, [i * gap_s for i in range(len(items))])


def _duration(records: Sequence[SimRecord]) -> float:
    ends = [r.token_times[-1] for r in records if r.token_times]
    return max(ends) - min(r.arrival for r in records) if ends else 0.0


def plan(inp: PlanInput, arms: Sequence[ArmSpec] | None = None) -> PlanResult:
    arms = (
        list(arms)
        if arms is not None
        else arms_for(inp.devices, inp.profile, inp.kv_blocks_per_device)
    )
    if not arms:
        raise ValueError(f"devices: {inp.devices} leaves no arm to simulate")
    probe = _unloaded_items(inp.workload, inp.vocab_size)
    unloaded = {a.name: unloaded_baseline(simulate_unloaded(a, inp.profile, probe)) for a in arms}
    slos = inp.slos or SLOs.from_unloaded(
        {
            c.name: (
                max(u[c.name][0] for u in unloaded.values()),
                max(u[c.name][1] for u in unloaded.values()),
            )
            for c in inp.workload.classes
        },
        inp.ttft_x,
        inp.tpot_x,
    )
    results = []
    for a in arms:
        recs, dur = simulate(
            a, inp.profile, inp.workload, inp.rate, inp.num_requests, inp.seed, inp.vocab_size
        )
        m = slo_metrics(recs, dur, slos)
        sweep = _sweep(a, inp, slos)
        k = knee([r for r, _, _ in sweep], [att for _, att, _ in sweep], inp.attainment)
        results.append(ArmResult(a, m, k, sweep, unloaded[a.name]))
    splits = [r for r in results if not r.arm.colocated]
    best = max(splits, key=lambda r: (r.knee_rate or 0.0, r.at_rate["goodput"]), default=None)
    return PlanResult(inp, slos, results, best)


def _unloaded_items(workload: WorkloadMix, vocab_size: int, per_class: int = 3) -> list[Any]:
    """A few requests of every class, for the unloaded baseline."""
    out: list[Any] = []
    seed = 1
    while any(sum(1 for i in out if i.cls == c.name) < per_class for c in workload.classes):
        for item in workload.items(16, vocab_size, seed=seed):
            if sum(1 for i in out if i.cls == item.cls) < per_class:
                out.append(item)
        seed += 1
    return out


def _sweep(arm: ArmSpec, inp: PlanInput, slos: SLOs) -> list[tuple[float, float, float]]:
    """Attainment at rates around ``inp.rate``: doubling up until it fails, then bisecting."""
    points: dict[float, tuple[float, float]] = {}

    def at(rate: float) -> float:
        if rate not in points:
            recs, dur = simulate(
                arm, inp.profile, inp.workload, rate, inp.num_requests, inp.seed, inp.vocab_size
            )
            m = slo_metrics(recs, dur, slos)
            points[rate] = (m["slo_attainment"], m["goodput"])
        return points[rate][0]

    lo, hi = 0.0, inp.rate
    for _ in range(inp.sweep_steps):  # find a failing rate above the passing ones
        if at(hi) < inp.attainment:
            break
        lo, hi = hi, 2 * hi
    else:
        hi = 0.0
    if hi:
        if lo == 0.0:  # even inp.rate fails: look below it
            lo = hi / 2**inp.sweep_steps
            at(lo)
        for _ in range(inp.sweep_steps):
            mid = (lo + hi) / 2
            if at(mid) >= inp.attainment:
                lo = mid
            else:
                hi = mid
    return sorted((r, a, g) for r, (a, g) in points.items())


def write_plot(result: PlanResult, path: Path) -> Path | None:
    """Attainment vs rate per arm, and goodput at the knee: a PNG (None without matplotlib)."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in result.arms:
        xs = [p[0] for p in r.sweep]
        ax1.plot(xs, [100 * p[1] for p in r.sweep], marker="o", label=r.arm.name)
    ax1.axhline(100 * result.input.attainment, color="grey", linestyle="--", linewidth=1)
    ax1.axvline(result.input.rate, color="grey", linestyle=":", linewidth=1)
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("SLO attainment (%)")
    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.legend(fontsize=8)
    names = [r.arm.name for r in result.arms]
    knees = [r.knee_rate or 0.0 for r in result.arms]
    colors = [
        "tab:green" if result.best is not None and r is result.best else "tab:blue"
        for r in result.arms
    ]
    positions = list(range(len(names)))  # numbers, not names: names like 1P1D parse as dates
    ax2.bar(positions, knees, color=colors)
    ax2.set_xticks(positions, names, rotation=30, fontsize=8)
    ax2.set_ylabel(f"goodput at >= {100 * result.input.attainment:.0f}% SLO (req/s)")
    inp = result.input
    fig.suptitle(
        f"pdserve plan: {inp.devices} devices, {inp.workload.name}, "
        f"{inp.profile.device.get('name', 'device')}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def write_json(result: PlanResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), indent=2, default=str))
