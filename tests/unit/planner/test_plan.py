"""``pdserve plan``: the splits of a device count and the colocated alternatives, their
predictions, the best split, the PNG; and clear errors for a bad profile or workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.planner.plan import PlanInput, arms_for, plan, write_plot
from cluster.planner.profile import EXAMPLE_PROFILE, Profile
from cluster.planner.workload import MIXED_LONG, WorkloadMix, load_workload
from tests.unit.planner.synthetic import synthetic_profile

ROOT = Path(__file__).resolve().parents[3]


def test_arms_cover_every_split_and_the_colocated_forms_with_equal_kv() -> None:
    prof = synthetic_profile()
    names = [a.name for a in arms_for(4, prof, 100)]
    assert names[:3] == ["1P3D", "2P2D", "3P1D"]
    assert "colocated" in names and "colocated_chunked" in names
    for arm in arms_for(2, prof, 100):
        replicas = arm.prefill + arm.decode
        assert arm.config.cache.num_blocks * replicas == 200, arm.name


def test_plan_predicts_every_arm_and_picks_a_split(tmp_path: Path) -> None:
    result = plan(
        PlanInput(synthetic_profile(), MIXED_LONG, 0.5, 2, num_requests=60, sweep_steps=3)
    )
    assert result.best is not None and result.best.arm.prefill > 0
    for r in result.arms:
        assert r.at_rate["completed"] == 60
        assert 0 <= r.at_rate["slo_attainment"] <= 1
        assert r.at_rate["ttft_s"]["p50"] <= r.at_rate["ttft_s"]["p90"]
    assert set(result.slos.bounds) == {"chat", "long"}
    png = write_plot(result, tmp_path / "plan.png")
    assert png is not None and png.stat().st_size > 1000


def test_bad_profiles_and_workloads_are_refused_naming_the_problem(tmp_path: Path) -> None:
    good = synthetic_profile().to_dict()
    cases = [
        ({**good, "format": "v0"}, "format"),
        ({k: v for k, v in good.items() if k != "steps"}, "missing section 'steps'"),
        ({**good, "model": {"block_size": 0, "bytes_per_block": 1}}, "model.block_size"),
        (
            {
                **good,
                "steps": {
                    "1": {**good["steps"]["1"], "prefill": {"tokens": [2, 1], "seconds": [1, 1]}}
                },
            },
            "strictly increasing",
        ),
        ({**good, "transfer": {"shm": {"fixed_s": 0, "bytes_per_s": 0}}}, "bytes_per_s"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            Profile.from_dict(data)
    with pytest.raises(ValueError, match="no such file"):
        Profile.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="neither a known name"):
        load_workload("nonsense")
    bad = tmp_path / "w.json"
    bad.write_text(
        json.dumps(
            {"name": "w", "classes": [{"name": "a", "share": 0.5, "prompt": [8, 4], "output": 3}]}
        )
    )
    with pytest.raises(ValueError, match="prompt"):
        load_workload(str(bad))
    with pytest.raises(ValueError, match="shares sum"):
        WorkloadMix.from_dict(
            {"classes": [{"name": "a", "share": 0.5, "prompt": [4, 8], "output": 3}]}
        )
    with pytest.raises(ValueError, match="no step costs"):
        synthetic_profile().costs(8)


@pytest.mark.timeout(300)
def test_plan_quick_on_the_shipped_profile(tmp_path: Path) -> None:
    assert Profile.load(EXAMPLE_PROFILE).serving, "the shipped profile has its serving costs"
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "plan", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("best split: ") for line in lines)
    keys = dict(p.split("=", 1) for p in lines[-1].split()[1:])
    assert lines[-1].startswith("PLAN ") and keys["best"].endswith("D")
    for arm in ("1P1D", "colocated", "colocated_chunked"):
        assert float(keys[f"{arm}_goodput"]) >= 0 and float(keys[f"{arm}_at_rate"]) > 0
    assert (tmp_path / "plan.png").stat().st_size > 1000
    payload = json.loads((tmp_path / "plan.json").read_text())
    assert payload["best_split"] == keys["best"]


def _with_tp2(factor: float) -> Profile:
    from tests.unit.planner.synthetic import costs

    prof = synthetic_profile()
    prof.steps["1tp2"] = costs(factor)  # an engine of two 1-thread ranks
    return prof


def test_tensor_parallel_sizes_are_searched_with_the_split_on_every_device() -> None:
    arms = {a.name: a for a in arms_for(4, _with_tp2(0.6), 100)}
    assert {"1P3D", "1P1D_tp2x2", "2P1D_tp1x2", "1P2D_tp2x1", "colocated_tp2"} <= set(arms)
    for arm in arms.values():
        cfg = arm.config
        p = cfg.for_pool("prefill").model.tensor_parallel_size
        d = cfg.for_pool("decode").model.tensor_parallel_size
        assert arm.prefill * p + arm.decode * d == 4 or arm.name.startswith("colocated_1x"), arm
        assert cfg.cache.num_blocks == 100 * d or arm.name.startswith("colocated_1x"), arm.name
    assert [a.name for a in arms_for(4, synthetic_profile(), 100)][:3] == ["1P3D", "2P2D", "3P1D"]


@pytest.mark.parametrize(("factor", "chosen"), [(0.3, True), (3.0, False)])
def test_the_plan_takes_tensor_parallelism_where_it_pays_and_says_why(
    factor: float, chosen: bool
) -> None:
    inp = PlanInput(_with_tp2(factor), MIXED_LONG, 0.5, 4, num_requests=60, sweep_steps=3)
    result = plan(inp)
    assert result.best is not None
    row = result.best.row()
    assert (max(row["P_tp"], row["D_tp"]) == 2) is chosen, result.tp_choice()
    why = result.tp_choice()
    assert why is not None and why.startswith(f"prefill TP {row['P_tp']}, decode TP {row['D_tp']}")
    assert "the best split at each other TP pair" in why
