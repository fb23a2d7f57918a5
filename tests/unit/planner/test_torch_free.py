"""The planner's torch-free import contract names every planner module but ``measure`` (the one
subpackage that runs the engine), so a new module cannot slip out of it unnoticed."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest

import cluster.planner

ROOT = Path(__file__).resolve().parents[3]


def test_every_planner_module_outside_measure_is_held_torch_free() -> None:
    tomllib = pytest.importorskip("tomllib")
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    (torch_free,) = [c for c in contracts if c["name"].startswith("The planner is torch-free")]
    modules = {
        f"cluster.planner.{m.name}"
        for m in pkgutil.iter_modules(cluster.planner.__path__)
        if m.name != "measure"
    }
    assert modules == set(torch_free["source_modules"])
    assert {"torch", "cluster.engine.engine"} <= set(torch_free["forbidden_modules"])
