"""What a running cluster exposes (docs/reliability/matrix.md S1, S7), listed with psutil.

Every listening socket of the session's Ray cluster, with a pdserve app deployed (the default
router.host, 127.0.0.1): pdserve's own sockets (each router replica's gRPC server, Serve's HTTP
proxy, each prefill replica's KV sender) listen on loopback only; in pdserve's replica processes
every other listener is Ray's own (as many as in a plain Serve replica of the same cluster); and
no HTTP listener of Ray's takes a job submission without the cluster's token.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
from ray import serve

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import fake_config
from tests.serve.cluster_helpers import App
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

APP = "pdserve-exposure"
LOOPBACK = ("127.0.0.1", "::1")


class Listener(NamedTuple):
    pid: int
    name: str
    ip: str
    port: int


@serve.deployment(name="Baseline")
class Baseline:
    """A plain Serve replica: what Ray itself listens on in a replica process."""

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    cfg = fake_config(
        **{
            "prefill.num_replicas": 1,
            "transfer.transports": ["shm", "zmq"],
            "prefill.num_cpus": 0.5,
            "decode.num_cpus": 0.5,
        }
    )
    deployed = App(serve_cluster, cfg, APP)
    try:
        yield deployed
    finally:
        deployed.close()


def ipv4(ip: str) -> str:
    """gRPC binds 127.0.0.1 on an IPv6 socket: ``::ffff:127.0.0.1`` is the same address."""
    mapped = ipaddress.ip_address(ip)
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)
    return ip


def cluster_listeners() -> list[Listener]:
    """Every listening TCP socket of this session's processes (the driver and its Ray)."""
    sid = os.getsid(0)
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if os.getsid(p.pid) != sid:
                continue
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.append(Listener(p.pid, p.info["name"], c.laddr.ip, c.laddr.port))
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return found


def test_pdserve_listens_on_loopback_and_router_host_only(app: App) -> None:
    """S1 (and issue 12.1: the gRPC listener was `*:9000`, Serve's proxy binding [::])."""
    assert app.generate(pb.GenerateRequest(prompt="t1 t2 t3"), timeout=30)  # serving
    router_pid = app.router.pid.remote().result(timeout_s=30)
    decode = next(iter(app.stats("decode").values()))
    decode_pid = decode["pid"]
    prefill = next(iter(app.stats("prefill").values()))
    baseline = serve.run(Baseline.bind(), name="ray-baseline", route_prefix=None)
    try:
        baseline_pid = baseline.pid.remote().result(timeout_s=60)
        listeners = cluster_listeners()
    finally:
        serve.delete("ray-baseline")
    table = "\n".join(f"{x.pid:>7} {x.name:<24} {x.ip}:{x.port}" for x in listeners)
    print(table)

    def at(port: int) -> list[Listener]:
        return [x for x in listeners if x.port == port]

    grpc_port, http_port = app.config.router.grpc_port, app.cluster.http_port
    kv_port = int(prefill["endpoint"].rsplit(":", 1)[1])
    # a decode replica's KV socket: its requests' KV when it is drained (live migration)
    decode_kv_port = int(decode["endpoint"].rsplit(":", 1)[1])
    assert {x.pid for x in at(grpc_port)} == {router_pid}, table
    assert at(http_port), table
    assert [x for x in at(kv_port) if x.pid == prefill["pid"]], table
    assert [x for x in at(decode_kv_port) if x.pid == decode_pid], table
    own = at(grpc_port) + at(http_port) + at(kv_port) + at(decode_kv_port)
    assert all(ipv4(x.ip) == "127.0.0.1" for x in own), table  # router.host, transfer.bind_host

    # Anything else listening in a pdserve replica is Ray's own: no more than Ray opens in a
    # plain Serve replica of the same cluster (its core worker and Serve's replica server).
    def others(pid: int) -> list[Listener]:
        return [x for x in listeners if x.pid == pid and x not in own]

    ray_own = len(others(baseline_pid))
    for role, pid in (("router", router_pid), ("decode", decode_pid), ("prefill", prefill["pid"])):
        assert len(others(pid)) <= ray_own, (role, others(pid), others(baseline_pid))
    app.assert_clean()


def test_no_listener_takes_a_job_without_the_ray_token(app: App, tmp_path: Path) -> None:
    """S7, probed: every HTTP listener of the cluster is offered a job submission (the jobs API
    of a dashboard, the job agent of Ray's dashboard agent) without a token."""
    sentinel = tmp_path / "job-ran"
    job = json.dumps({"entrypoint": f"touch {sentinel}", "submission_id": "s7-probe"}).encode()
    refused: dict[str, int] = {}
    accepted = []
    for x in cluster_listeners():
        host = "127.0.0.1" if x.ip in ("0.0.0.0", "::") else x.ip
        host = f"[{host}]" if ":" in host else host
        for path in ("/api/jobs/", "/api/job_agent/jobs/"):
            url = f"http://{host}:{x.port}{path}"
            req = urllib.request.Request(
                url, data=job, method="POST", headers={"content-type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=3) as r:
                    accepted.append((x, path, r.status, r.read(200)))
            except urllib.error.HTTPError as e:
                refused[f"{x.name}:{x.port}{path}"] = e.code
            except (OSError, ValueError, http.client.HTTPException):  # gRPC, zmq, closed
                continue
    assert not accepted, accepted
    # The jobs API is there (on Ray's dashboard agent) and it is the token that refuses.
    assert 401 in refused.values(), refused
    time.sleep(1.0)
    assert not sentinel.exists()
    # No dashboard head at all (pdserve serve starts none unless --dashboard, then on 127.0.0.1).
    for x in cluster_listeners():
        if ipv4(x.ip) not in LOOPBACK:
            try:
                url = f"http://127.0.0.1:{x.port}/api/version"
                with urllib.request.urlopen(url, timeout=3) as r:
                    body = r.read(4096)
            except (OSError, ValueError, http.client.HTTPException):
                continue
            assert b"ray_version" not in body, x
