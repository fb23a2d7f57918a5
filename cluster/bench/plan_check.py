"""``pdserve plan --validate``: the planner's predictions against what ``bench serve`` measures.

For 3 workload mixes (``mixed-long``, ``chat-heavy``, ``long-heavy``: the same two request classes
in other shares) at one rate each, and the arms that fit on this machine (``bench serve``'s
``disagg`` 1P1D, ``colocated``, ``colocated_chunked``, with the same configs, deployed side by
side once), the same seeded requests are
  * simulated (``cluster.planner``) on this machine's profile (measured first with ``pdserve
    profile --quick`` unless ``--profile`` names one), and
  * sent to the arms over gRPC (``bench serve``'s load generator and interleaving),
and the predicted p50/p90 TTFT, p50/p90 TPOT and goodput are compared with the measured ones
(goodput against the per-class SLOs ``bench serve`` sets from the measured unloaded runs, the
same bounds for both). The check passes when every figure is within 25%.

Last line: ``RESULT plan-check within_25pct=<share of figures> max_error=<largest |error|>
passed=<0|1>``; the JSON (``bench/results/plan-check.json``) has every figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from cluster.bench.harness import BenchContext
from cluster.bench.serve import ARMS, arm_config, class_slos, measure
from cluster.bench.serve_load import compute_metrics, local_apps
from cluster.bench.workloads import bench_model_dir
from cluster.config import ClusterConfig
from cluster.planner.cli import print_table
from cluster.planner.metrics import slo_metrics
from cluster.planner.plan import simulate
from cluster.planner.profile import Profile
from cluster.planner.simulator import ArmSpec
from cluster.planner.workload import WORKLOADS

MIXES = {"mixed-long": 0.5, "chat-heavy": 0.75, "long-heavy": 0.3}
FIGURES = (
    ("ttft_p50", "ttft_s", "p50"),
    ("ttft_p90", "ttft_s", "p90"),
    ("tpot_p50", "tpot_s", "p50"),
    ("tpot_p90", "tpot_s", "p90"),
    ("goodput", "goodput", ""),
)
TOLERANCE = 0.25


def _figure(m: dict[str, Any], key: str, sub: str) -> float:
    return float(m[key][sub] if sub else m[key])


def run_check(config: ClusterConfig, mode: str, profile_path: Path | None, out: Path) -> int:
    from cluster.bench.profile import run_profile
    from cluster.config.model_paths import model_limits

    ctx = BenchContext(name="plan-check", mode=mode, config=config)
    model = str(bench_model_dir(ctx))
    config = config.replace({"model.path": model})
    if profile_path is None:
        profile_path = out / "profile.json"
        ctx.progress(f"measuring this machine's profile into {profile_path}")
        run_profile(
            config, "quick" if mode != "smoke" else "smoke", profile_path, progress=ctx.progress
        )
    profile = Profile.load(profile_path)
    total = ctx.pick(1400, 1400, 256)
    configs = {arm: arm_config(config, arm, total, model) for arm in ARMS}
    transport = next(t for t in configs["disagg"].transfer.transports if t in profile.transfer)
    specs = {
        arm: ArmSpec(
            arm, ARMS[arm]["prefill.num_replicas"], ARMS[arm]["decode.num_replicas"], cfg, transport
        )
        for arm, cfg in configs.items()
    }
    vocab = model_limits(configs["disagg"]).vocab_size
    per_rate = ctx.pick(40, 24, 6)
    scale = ctx.pick(1.0, 1.0, 0.05)
    # --smoke checks the harness on the tiny model (its figures mean nothing): its six requests
    # arrive at four times the mix's rate, within seconds.
    rate_x = ctx.pick(1.0, 1.0, 4.0)
    mixes = list(MIXES.items()) if mode != "smoke" else list(MIXES.items())[:1]
    rows: list[dict[str, Any]] = []
    slos = None
    with local_apps() as put:
        for i, (name, mix_rate) in enumerate(mixes):
            workload = WORKLOADS[name]
            rate = mix_rate * rate_x
            runs = measure(
                put,
                configs,
                workload,
                [rate],
                per_rate,
                per_class=ctx.pick(4, 2, 1) if i == 0 else 0,
                vocab=vocab,
                scale=scale,
                progress=ctx.progress,
                deploy=i == 0,
            )
            if slos is None:
                slos = class_slos(runs.unloaded)
            for arm, spec in specs.items():
                recs, dur = runs.loaded[arm][rate]
                measured = compute_metrics(recs, dur, slos=slos)
                sim, sim_dur = simulate(
                    spec, profile, workload, rate, per_rate, 100, vocab, scale=scale
                )
                predicted = slo_metrics(sim, sim_dur, slos)
                for label, key, sub in FIGURES:
                    p, m = _figure(predicted, key, sub), _figure(measured, key, sub)
                    err = p / m - 1 if m else (0.0 if p == m else float("inf"))
                    rows.append(
                        {
                            "mix": name,
                            "rate": rate,
                            "arm": arm,
                            "figure": label,
                            "predicted": p,
                            "measured": m,
                            "error_%": 100 * err,
                        }
                    )
                ctx.progress(
                    f"{name} {arm}: "
                    + ", ".join(
                        f"{r['figure']} {r['error_%']:+.0f}%" for r in rows[-len(FIGURES) :]
                    )
                )
    print_table(rows)
    errors = [abs(r["error_%"]) / 100 for r in rows]
    within = sum(1 for e in errors if e <= TOLERANCE) / len(errors)
    passed = within == 1.0
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "mode": mode,
        "profile": str(profile_path),
        "tolerance": TOLERANCE,
        "slos": slos.to_dict() if slos else {},
        "rows": rows,
        "within_25pct": within,
        "max_error": max(errors),
        "passed": passed,
    }
    (out / "plan-check.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'plan-check.json'}", file=sys.stderr)
    print(
        f"RESULT plan-check within_25pct={within:.3g} max_error={max(errors):.3g} "
        f"passed={int(passed)}",
        flush=True,
    )
    return 0 if passed or mode == "smoke" else 1
