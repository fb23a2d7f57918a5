"""``pdserve plan`` (without ``--validate``): simulate the splits, print the table, write JSON+PNG.

The last stdout line is ``PLAN best=<split> goodput=<req/s at the knee> ...`` (one key per arm:
``<arm>_goodput``, the arm's goodput at its knee, and ``<arm>_at_rate``, its goodput at
``--rate``), like a benchmark's RESULT line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cluster.planner.plan import PlanInput, plan, write_json, write_plot
from cluster.planner.profile import EXAMPLE_PROFILE, Profile
from cluster.planner.workload import load_workload


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = list(dict.fromkeys(k for row in rows for k in row))
    widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for row in rows:
        print("  ".join(_fmt(row.get(c, "")).ljust(widths[c]) for c in cols))


def run_plan(
    *,
    profile: Path | None,
    workload: str,
    rate: float,
    devices: int,
    quick: bool,
    out: Path,
    kv_blocks_per_device: int = 700,
) -> int:
    path = profile or EXAMPLE_PROFILE
    prof = Profile.load(path)
    inp = PlanInput(
        prof,
        load_workload(workload),
        rate=rate,
        devices=devices,
        num_requests=100 if quick else 300,
        sweep_steps=5 if quick else 7,
        kv_blocks_per_device=kv_blocks_per_device,
    )
    print(
        f"pdserve plan: {devices} devices of {prof.device.get('name', '?')} ({path.name}), "
        f"workload {inp.workload.name}, {rate} req/s, {inp.num_requests} requests per run",
        file=sys.stderr,
    )
    result = plan(inp)
    print_table([r.row() for r in result.arms])
    print(
        "SLOs (s): "
        + ", ".join(f"{c} TTFT {t:.3g} TPOT {p:.3g}" for c, (t, p) in result.slos.bounds.items())
    )
    best = result.best
    if best is not None:
        print(
            f"best split: {best.arm.name} (goodput {best.knee_rate or 0:.3g} req/s at >= "
            f"{100 * inp.attainment:.0f}% SLO attainment)"
        )
        print(f"tensor parallelism: {result.tp_choice()}")
    overall = result.best_overall
    print(f"best arm overall: {overall.arm.name} (goodput {overall.knee_rate or 0:.3g} req/s)")
    out.mkdir(parents=True, exist_ok=True)
    write_json(result, out / "plan.json")
    png = write_plot(result, out / "plan.png")
    print(f"wrote {out / 'plan.json'}" + (f" and {png}" if png else ""), file=sys.stderr)
    keys = {
        "best": best.arm.name if best else "none",
        "best_prefill_tp": best.row()["P_tp"] if best else 0,
        "best_decode_tp": best.row()["D_tp"] if best else 0,
        "best_overall": overall.arm.name,
        "devices": devices,
    }
    for r in result.arms:
        keys[f"{r.arm.name}_goodput"] = r.knee_rate or 0.0
        keys[f"{r.arm.name}_at_rate"] = r.at_rate["goodput"]
    print("PLAN " + " ".join(f"{k}={_fmt(v)}" for k, v in keys.items()), flush=True)
    return 0
