"""`pdserve bench serve --smoke` (P1) and `pdserve bench routing --smoke` (P8) run their arms end
to end on their own local Ray (the tiny model: the figures mean nothing, the harness is checked)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import SHORT_SHUTDOWN_SETS
from tests.serve_fixtures import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEYS = {
    "serve": {
        "goodput_ratio_vs_colocated",
        "p99_tpot_ratio_vs_colocated",
        "goodput_ratio_vs_chunked",
        "knee_found",
    },
    "routing": {"hit_rate", "hit_rate_rr", "ttft_ratio", "router_overhead_ms"},
}
ARMS = {
    "serve": {"disagg", "colocated", "colocated_chunked"},
    "routing": {"prefix_aware", "round_robin"},
}


@pytest.mark.parametrize("name", ["serve", "routing"])
def test_bench_smoke(tmp_path: Path, name: str) -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "cluster.cli", "bench", name, "--smoke"),
            *("--set", f"router.http_port={free_port()}"),
            *("--set", f"router.grpc_port={free_port()}"),
            *SHORT_SHUTDOWN_SETS,
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["RESULT", name], last
    keys = {k: float(v) for k, v in (p.split("=", 1) for p in last[2:])}
    assert set(keys) == KEYS[name] and all(math.isfinite(v) and v >= 0 for v in keys.values())
    results = tmp_path / "bench" / "results"
    payload = json.loads((results / f"{name}.json").read_text())
    assert {row["arm"] for row in payload["table"]} == ARMS[name]
    assert all(row["failed"] == 0 for row in payload["table"])
    if name == "serve":
        assert (results / "serve_latency_cdf.png").stat().st_size > 1000
    else:
        assert keys["hit_rate"] > 0  # groups stuck to a replica even on the tiny model
