"""`pdserve plan --validate --smoke`: the planner check end to end (the tiny model, one mix, a
few requests): a profile is measured, the same seeded requests are simulated and sent to bench
serve's three arms, and every figure is compared. It runs in this process through the CLI, on
the session's shared Ray/Serve instance (the arms deployed onto it as applications and deleted
after). The figures mean nothing on the tiny model; the full check (`pdserve plan --validate`)
is in docs/benchmarks/planner.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cluster import cli
from tests.helpers import SHORT_SHUTDOWN_SETS
from tests.serve_fixtures import ServeCluster, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_plan_validate_smoke(
    serve_cluster: ServeCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ray import serve

    monkeypatch.chdir(tmp_path)
    rc = cli.main(
        [
            *("plan", "--validate", "--smoke"),
            *("--out", str(tmp_path / "results")),
            *("--set", f"router.http_port={serve_cluster.http_port}"),
            *("--set", f"router.grpc_port={free_port()}"),
            *SHORT_SHUTDOWN_SETS,
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    last = out.strip().splitlines()[-1].split()
    assert last[:2] == ["RESULT", "plan-check"], last
    keys = {k: float(v) for k, v in (p.split("=", 1) for p in last[2:])}
    assert set(keys) == {
        "within_25pct",
        "max_error",
        "resolvable_25pct",
        "exact_model_pass_p",
        "passed",
    }
    assert 0 <= keys["exact_model_pass_p"] <= 1
    assert 0 <= keys["resolvable_25pct"] <= 1
    payload = json.loads((tmp_path / "results" / "plan-check.json").read_text())
    rows = payload["rows"]
    # Per mix and arm, the chance an exact model passes that run's figures (one mix in smoke).
    assert set(payload["exact_pass"]) == {"mixed-long"}
    assert all(0 <= p <= 1 for p in payload["exact_pass"]["mixed-long"].values())
    assert math.prod(payload["exact_pass"]["mixed-long"].values()) == pytest.approx(
        payload["exact_model_pass_p"]
    )
    # Each arm's long prompts' prefill under load (None here: the tiny model's are short).
    loaded = payload["loaded_prefill_scale"]["mixed-long"]
    assert set(loaded) == {"disagg", "colocated", "colocated_chunked"}
    assert all(v is None or v > 0 for v in loaded.values())
    assert {r["arm"] for r in rows} == {"disagg", "colocated", "colocated_chunked"}
    assert {r["figure"] for r in rows} == {
        "ttft_p50",
        "ttft_p90",
        "tpot_p50",
        "tpot_p90",
        "goodput",
    }
    assert all(math.isfinite(r["predicted"]) and r["predicted"] >= 0 for r in rows)
    assert all(math.isfinite(r["measured"]) and r["measured"] >= 0 for r in rows)
    # Each measured figure's own sampling interval (bootstrap; inf where the figure is 0).
    assert all(r["sampling_%"] >= 0 for r in rows)
    # The tiny model can outrun the stream: a request's later tokens then arrive in one message
    # and its TPOT is 0 (a colocated_chunked tpot_p50 of 0.0 failed a fresh-clone run). TTFT is
    # never 0 for requests that were served. Goodput (requests inside their SLOs per second) may
    # be: a fresh-clone run on 2 loaded cores measured an arm with none inside.
    ttft = [r for r in rows if r["figure"].startswith("ttft")]
    assert all(r["measured"] > 0 for r in ttft), [(r["arm"], r["figure"]) for r in ttft]
    assert (tmp_path / "results" / "profile.json").exists()
    # The serving section was re-calibrated on this deployment, for every arm.
    assert set(payload["serving"]) == {"disagg", "colocated", "colocated_chunked"}
    serving = payload["serving"].values()
    assert all(c["prefill_scale"] > 0 and c["decode_scale"] > 0 for c in serving)
    # ... including the cost per concurrent stream, from a burst of 2 sent to each arm at once.
    assert all(c["stream_s"] >= 0 for c in serving)
    # (The tiny model can outrun the stream: a request in fewer than 3 chunks does not count.)
    # One burst per mix (the smoke check runs one mix).
    assert all(
        [b["requests"] for b in raw["bursts"]] == [2] for raw in payload["calibration"].values()
    )
    # The hypervisor's share while the profile and the calibration ran (None: no /proc/stat).
    assert set(payload["steal_%"]) == {"profile", "calibration"}
    assert all(v is None or 0 <= v <= 100 for v in payload["steal_%"].values())
    # The shared instance runs on, without the check's applications.
    assert not set(serve.status().applications) & {"disagg", "colocated", "colocated_chunked"}
