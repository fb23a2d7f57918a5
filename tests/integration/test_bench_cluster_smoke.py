"""`pdserve bench serve --smoke` (P1), `pdserve bench routing --smoke` (P8) and `pdserve bench
anchor-serve --smoke` (GuideLLM against the pdserve arms; no llama-server in smoke) run their
arms end to end (the tiny model: the figures mean nothing, the harness is checked). They run in this
process through the CLI, on the session's shared Ray/Serve instance: their arms are deployed
onto it as applications and deleted after."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cluster import cli
from tests.helpers import SHORT_SHUTDOWN_SETS
from tests.serve_fixtures import ServeCluster, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEYS = {
    "serve": {
        "goodput_ratio_vs_colocated",
        "p99_tpot_ratio_vs_colocated",
        "goodput_ratio_vs_chunked",
        "knee_found",
    },
    "routing": {"hit_rate", "hit_rate_rr", "ttft_ratio", "router_overhead_ms"},
    "anchor-serve": {
        f"{k}_vs_llamaserver{suffix}"
        for k in ("c1_out_tok_s", "c8_out_tok_s", "c8_ttft_p50")
        for suffix in ("", "_default")
    },
}
ARMS = {
    "serve": {"disagg", "colocated", "colocated_chunked"},
    "routing": {"prefix_aware", "round_robin"},
    "anchor-serve": {"pdserve_default", "pdserve_colocated"},
}


@pytest.mark.parametrize(
    "name",
    [
        "serve",
        "routing",
        # two tiny-model deployments and two GuideLLM runs (~100 s): nightly; GuideLLM against
        # the cluster, and this benchmark's reading of its report, run in every CI in
        # tests/serve/test_client_compat.py
        pytest.param("anchor-serve", marks=pytest.mark.nightly),
    ],
)
def test_bench_smoke(
    serve_cluster: ServeCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
) -> None:
    from ray import serve

    monkeypatch.chdir(tmp_path)  # bench/results lands here
    rc = cli.main(
        [
            *("bench", name, "--smoke"),
            # Serve's HTTP proxy is the session's (bench routing times completions through it).
            *("--set", f"router.http_port={serve_cluster.http_port}"),
            *("--set", f"router.grpc_port={free_port()}"),
            *SHORT_SHUTDOWN_SETS,
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    last = out.strip().splitlines()[-1].split()
    assert last[:2] == ["RESULT", name], last
    keys = {k: float(v) for k, v in (p.split("=", 1) for p in last[2:])}
    assert set(keys) == KEYS[name]
    results = tmp_path / "bench" / "results"
    payload = json.loads((results / f"{name}.json").read_text())
    assert {row["arm"] for row in payload["table"]} == ARMS[name]
    if name == "anchor-serve":  # ratios to llama-server, which smoke leaves out: NaN
        assert all(math.isnan(v) for v in keys.values())
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in payload["table"])
        assert all(r["out_tok_s"] > 0 for r in payload["table"])
    else:
        assert all(math.isfinite(v) and v >= 0 for v in keys.values())
        assert all(row["failed"] == 0 for row in payload["table"])
    if name == "serve":
        assert (results / "serve_latency_cdf.png").stat().st_size > 1000
    elif name == "routing":
        assert keys["hit_rate"] > 0  # groups stuck to a replica even on the tiny model
    # The shared instance runs on, without the benchmark's applications.
    assert not set(serve.status().applications) & (ARMS[name] | {"pdserve"})
