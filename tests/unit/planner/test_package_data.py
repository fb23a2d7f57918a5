"""The example profile ``pdserve plan`` reads by default ships in the wheel (a non-editable
install, as the Docker image's, has only what package-data names beside the modules)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.planner.profile import EXAMPLE_PROFILE

ROOT = Path(__file__).resolve().parents[3]


def test_every_shipped_profile_is_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["cluster"]
    package = ROOT / "cluster"
    profiles = sorted(EXAMPLE_PROFILE.parent.iterdir())
    assert EXAMPLE_PROFILE in profiles
    for path in profiles:
        relative = path.relative_to(package)
        assert any(relative.match(p) for p in patterns), f"{relative} is not package data"
