"""``pdserve profile --tp``: step costs of tensor-parallel engines beside the one-rank ones, under
keys the planner reads (``steps_key``), and the plan's TP search over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.planner.measure.profiler import run_profile
from cluster.planner.plan import PlanInput, arms_for, plan
from cluster.planner.profile import Profile, steps_key
from cluster.planner.workload import MIXED_LONG
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(300)


def test_a_profile_measures_two_ranks_beside_one_and_the_plan_searches_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "profile.json"
    config = make_config(**{"model.path": str(tiny_model_dir)})
    run_profile(config, "smoke", out, [1], serving=False, tp_sizes=(1, 2), progress=lambda m: None)
    prof = Profile.load(out)
    assert set(prof.steps) == {steps_key(1), steps_key(1, 2)} == {"1", "1tp2"}
    assert prof.tensor_parallel_sizes(1) == [1, 2]
    assert prof.costs(1, 2) is prof.steps["1tp2"]
    with pytest.raises(ValueError, match="no step costs for '1tp4'"):
        prof.costs(1, 4)
    names = {a.name for a in arms_for(2, prof, 100)}
    assert {"1P1D", "colocated", "colocated_tp2"} <= names
    result = plan(PlanInput(prof, MIXED_LONG, 0.2, 2, num_requests=30, sweep_steps=2))
    assert any(r.arm.name == "colocated_tp2" for r in result.arms)
