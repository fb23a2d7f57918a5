"""README's metrics table is the canonical list: it matches what the code exports."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.serving.metrics import METRIC_NAMES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_exactly_the_exported_metrics() -> None:
    listed = set(re.findall(r"^\| `(ray_pdserve_\w+)` \|", README.read_text(), re.M))
    assert listed == set(METRIC_NAMES)
