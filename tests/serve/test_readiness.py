"""Readiness on Ray Serve (reliability matrix F22, issue 12.4): ``/health`` and the gRPC health
service say SERVING only while both pools can take a request: not while the app's pools start,
not while the only decode (or prefill) replica is being replaced; and a request sent the moment
health turns SERVING succeeds, promptly and oracle-identical.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import fake_config, greedy, run_until_done
from tests.serve.cluster_helpers import App, wait_replicas_ready
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CFG = {
    "prefill.num_replicas": 1,
    "decode.num_replicas": 1,
    "decode.local_prefill_threshold": 16,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "router.readiness_period_s": 0.2,
    # An early request waits this long for a replica before it fails UNAVAILABLE: short, so
    # that "SERVING" said too early shows as a failed request.
    "router.assignment_timeout_s": 3.0,
    "router.retries": 0,
}
PROMPT = [1 + (j * 13) % 500 for j in range(40)]  # remote prefill: both pools take part


def expected_tokens() -> list[int]:
    engine = LLMEngine(fake_config(**CFG))
    engine.add(EngineRequest("x", PROMPT, greedy(6)))
    return run_until_done(engine)["x"]


def request(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParameters(
            max_tokens=6, min_tokens=6, temperature=0.0, ignore_eos=True
        ),
    )


def grpc_health(app: App) -> str:
    stub = health_pb2_grpc.HealthStub(app.channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError:
        return "down"  # not listening yet (the router replica is starting)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def http_health(app: App) -> int:
    try:
        with urllib.request.urlopen(app.cluster.http_url + "/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def first_serving_then_request(app: App, expected: list[int], timeout: float = 120) -> list[str]:
    """Poll health until SERVING; at once send a request: it must succeed, oracle-identical,
    without waiting for a replica to come up. Returns the gRPC statuses seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = grpc_health(app)
        seen.append(status)
        if status == "SERVING":
            assert http_health(app) == 200
            t0 = time.monotonic()
            got = [
                t
                for m in app.generate(request(f"f22-{len(seen)}"), timeout=30)
                for t in m.token_ids
            ]
            assert got == expected
            assert time.monotonic() - t0 < 5.0, "health said SERVING before a replica could serve"
            return seen
        time.sleep(0.05)
    raise AssertionError(f"never SERVING within {timeout} s: {seen[-10:]}")


# The pools' replicas take this long to load their model, as a real model does: the router,
# started at the same time, is then answering health checks while its pools are still starting
# (without it the router replica can come up last on a loaded machine and see ready pools).
LOAD_DELAY_S = 6.0


def test_not_serving_until_both_pools_can_take_a_request(serve_cluster: ServeCluster) -> None:
    expected = expected_tokens()
    config = fake_config(**CFG, **{"testing.fake_model.load_delay_s": LOAD_DELAY_S})
    app = App(serve_cluster, config, "pdserve-ready-start", blocking=False)
    try:
        seen = first_serving_then_request(app, expected)
        # The router answered while its pools were still starting, and said so.
        assert "NOT_SERVING" in seen, seen[:20]
        app.assert_clean()
    finally:
        app.close()


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    deployed = App(serve_cluster, fake_config(**CFG), "pdserve-ready")
    try:
        yield deployed
    finally:
        deployed.close()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_not_serving_while_the_only_replica_of_a_pool_is_replaced(app: App, role: str) -> None:
    expected = expected_tokens()
    assert first_serving_then_request(app, expected)[-1] == "SERVING"
    victim: dict[str, Any] = next(iter(app.stats(role).values()))
    t_kill = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    went_down = None
    while time.monotonic() - t_kill < 10:
        if grpc_health(app) == "NOT_SERVING" and http_health(app) == 503:
            went_down = time.monotonic() - t_kill
            break
        time.sleep(0.05)
    assert went_down is not None, f"health still SERVING 10 s after the {role} replica died"
    seen = first_serving_then_request(app, expected)
    assert seen[0] == "NOT_SERVING"
    wait_replicas_ready(app, role, victim["pid"])
    assert serve.status().applications[app.name].status == "RUNNING"
    app.assert_clean()
