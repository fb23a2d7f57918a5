"""`pdserve bench serve --smoke` (P1) runs its three arms end to end on its own local Ray."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_fixtures import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEYS = {"goodput_ratio_vs_colocated", "p99_tpot_ratio_vs_colocated", "goodput_ratio_vs_chunked"}


def test_bench_serve_smoke(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "cluster.cli", "bench", "serve", "--smoke"),
            *("--set", f"router.http_port={free_port()}"),
            *("--set", f"router.grpc_port={free_port()}"),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["RESULT", "serve"], last
    keys = {k: float(v) for k, v in (p.split("=", 1) for p in last[2:])}
    assert set(keys) == KEYS and all(math.isfinite(v) and v > 0 for v in keys.values())
    results = tmp_path / "bench" / "results"
    payload = json.loads((results / "serve.json").read_text())
    assert {row["arm"] for row in payload["table"]} == {"disagg", "colocated", "colocated_chunked"}
    assert all(row["failed"] == 0 for row in payload["table"])
    assert (results / "serve_latency_cdf.png").stat().st_size > 1000
