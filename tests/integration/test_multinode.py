"""A real two-node Ray cluster on this machine (issue 12.9): docs/operations/running.md's recipe.

`ray start --head` (offering `pdserve_prefill` and `pdserve_router`) and a second `ray start`
joining it (offering `pdserve_decode`), then `pdserve serve --address`, exactly as on two
machines. The pools land on their own nodes, KV moves over the zmq TCP transport only (no shared
memory between the nodes), and outputs are oracle-identical to an offline engine. Then the
decode node dies (its raylet and every process it started, SIGKILL): streams in flight end with
a status (never hang), the cluster says NOT_SERVING, and once a node offering `pdserve_decode`
joins again Serve brings the decode replica back there and outputs are exact again. It ends with
both pools' block-integrity check.

This Ray is not the pytest session's: it has its own temp dir (so no `ray.init()` elsewhere
finds it), its own token, and each node's processes carry a marker in their environment, by
which the test kills one node, and at the end everything it started (never `ray stop`, which
would stop every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import load_config
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import greedy, run_until_done
from tests.serve_fixtures import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARK = "PDSERVE_TEST_RAY_NODE"  # in the environment of every process a node started
MAX_TOKENS = 8
PROMPTS = {f"r{i}": [1 + (i * 29 + j * 7) % 500 for j in range(20 + 9 * i)] for i in range(6)}


def _config(http_port: int, grpc_port: int) -> dict[str, Any]:
    return {
        "testing": {"enabled": True},
        "model": {"runner": "fake", "num_threads": 1},
        "cache": {"num_blocks": 96},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "chunk_size": 16},
        # Two nodes: KV crosses between them over TCP, never through one host's shared memory.
        "transfer": {"transports": ["zmq"], "lease_s": 5.0, "heartbeat_s": 0.5},
        "router": {
            "host": "127.0.0.1",
            "http_port": http_port,
            "grpc_port": grpc_port,
            "num_replicas": 1,
            "resources": {"pdserve_router": 1},
            "num_cpus": 0.1,
            "readiness_period_s": 0.5,
            "assignment_timeout_s": 5.0,
        },
        "prefill": {"num_replicas": 1, "resources": {"pdserve_prefill": 1}, "num_cpus": 0.2},
        "decode": {
            "num_replicas": 1,
            "resources": {"pdserve_decode": 1},
            "num_cpus": 0.2,
            "local_prefill_threshold": 16,  # every prompt here is prefilled remotely
        },
    }


class RayCluster:
    """Nodes started with `ray start`, each marked, killed by marker (this test's only)."""

    def __init__(self, tmp: Path) -> None:
        self.run_id = secrets.token_hex(4)
        # Short: Ray's unix socket paths live under it (108-byte limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {
            "PATH": f"{BIN}:/usr/bin:/bin",
            "HOME": str(Path.home()),
            "PYTHONPATH": str(ROOT),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1",
            "PDSERVE_CACHE_DIR": str(tmp / "cache"),
        }
        self.log = tmp / "ray-start.log"

    def start_node(self, name: str, resources: dict[str, float], *, head: bool = False) -> None:
        args = ["--head", f"--port={self.port}", "--include-dashboard=false"] if head else []
        if head:
            args.append(f"--temp-dir={self.temp_dir}")
        else:
            args.append(f"--address={self.address}")
        cmd = [
            str(BIN / "ray"),
            "start",
            *args,
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            f"--resources={json.dumps(resources)}",
            "--disable-usage-stats",
        ]
        env = {**self.env, MARK: f"{self.run_id}:{name}"}
        with self.log.open("a") as log:
            out = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=180)
        assert out.returncode == 0, self.log.read_text()[-3000:]

    def processes(self, name: str | None = None) -> list[psutil.Process]:
        """The processes ``name`` (default: every node) started, and all their descendants.

        The marker is read from the processes `ray start` launched itself (GCS, raylet, log
        monitor: their environment is intact); workers and agents are found as the raylet's
        descendants, since a process that retitles itself (Ray's workers do) may lose its
        environment block."""
        want = f"{self.run_id}:{name}" if name else None
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            try:
                mark = p.environ().get(MARK, "")
                if not mark.startswith(f"{self.run_id}:") or want not in (None, mark):
                    continue
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
            except (psutil.Error, OSError):
                continue
        return list(found.values())

    def kill(self, name: str | None = None) -> int:
        procs = self.processes(name)
        for p in procs:  # all at once: a raylet's children do not outlive it
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        return len(procs)

    def replica_nodes(self, deployment: str, nodes: tuple[str, ...]) -> set[str]:
        """Which of ``nodes`` run a live replica process of ``deployment``."""
        found = set()
        for node in nodes:
            for p in self.processes(node):
                try:
                    alive = p.status() != psutil.STATUS_ZOMBIE
                    if alive and deployment in " ".join(p.cmdline()):
                        found.add(node)
                except psutil.Error:
                    continue
        return found

    def probe(self, script: str) -> Any:
        """Run ``script`` in a driver connected to this cluster; it prints one JSON line."""
        code = (
            "import json, ray\nfrom ray import serve\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n" + script
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[RayCluster]:
    cluster = RayCluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.kill()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def _request(rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParameters(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def _health(channel: grpc.Channel) -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2
        )
    except grpc.RpcError:
        return "down"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _wait_health(channel: grpc.Channel, want: str, timeout: float, server: Any) -> float:
    t0 = time.monotonic()
    seen = []
    while time.monotonic() - t0 < timeout:
        assert server.poll() is None, "pdserve serve exited"
        seen.append(_health(channel))
        if seen[-1] == want:
            return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"not {want} within {timeout} s: {seen[-5:]}")


def _generate_all(stub: Any, tag: str) -> dict[str, list[int]]:
    out = {}
    for rid, p in PROMPTS.items():
        replies = stub.Generate(_request(f"{tag}-{rid}", p), timeout=60)
        out[rid] = [t for m in replies for t in m.token_ids]
    return out


INTEGRITY = """
out = {}
for name in ("PrefillServer", "DecodeServer"):
    h = serve.get_deployment_handle(name, app_name="pdserve")
    s = h.stats.remote().result(timeout_s=30)
    out[name] = [h.check_integrity.remote().result(timeout_s=30), s["kv_used_blocks"],
                 s.get("num_active_leases", 0)]
print(json.dumps(out))
"""


def _oracle(config_file: Path) -> dict[str, list[int]]:
    """Every prompt's greedy output from an offline engine of the same configuration."""
    engine = LLMEngine(load_config(config_file))
    for rid, p in PROMPTS.items():
        engine.add(EngineRequest(rid, p, greedy(MAX_TOKENS)))
    return run_until_done(engine)


def _kill_the_decode_node_mid_stream(ray_cluster: RayCluster, stub: Any, node: str) -> None:
    """The decode node dies with streams in flight: each ends with a status, none hangs."""
    long_calls = [
        stub.Generate(_request(f"inflight-{i}", PROMPTS["r3"], 400), timeout=60) for i in range(3)
    ]
    for call in long_calls:  # every stream has started (a first token each)
        while not next(call).token_ids:
            pass
    t_kill = time.monotonic()
    assert ray_cluster.kill(node) > 0
    for call in long_calls:
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    assert time.monotonic() - t_kill < 45, "streams on the dead node were not ended"


def _check_integrity_once_idle(ray_cluster: RayCluster) -> None:
    """Both pools pass their block-integrity check with no block or lease held (waiting up to
    30 s for the last releases)."""
    deadline = time.monotonic() + 30
    while True:
        state = ray_cluster.probe(INTEGRITY)
        if all(v[1:] == [0, 0] for v in state.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert state == {"PrefillServer": ["ok", 0, 0], "DecodeServer": ["ok", 0, 0]}, state


def test_pools_on_two_ray_nodes_exact_outputs_node_death_and_return(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    http_port, grpc_port = free_port(), free_port()
    raw = _config(http_port, grpc_port)
    config_file = tmp_path / "pdserve.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    expected = _oracle(config_file)  # before any cluster starts

    t0 = time.monotonic()

    def phase(what: str) -> None:
        print(f"multinode: {what} at {time.monotonic() - t0:.1f} s", flush=True)

    ray_cluster.start_node("head", {"pdserve_prefill": 1, "pdserve_router": 1}, head=True)
    ray_cluster.start_node("decode-a", {"pdserve_decode": 1})
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "cluster.cli", "serve"),
            *("--address", ray_cluster.address, "--config", str(config_file)),
        ],
        env={**ray_cluster.env, MARK: f"{ray_cluster.run_id}:driver"},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = pb_grpc.GenerationStub(channel)
    try:
        _wait_health(channel, "SERVING", 240, server)
        phase("two nodes up, serving")
        # Each pool on the node offering its resource; the prefills were remote, over TCP.
        nodes = ("head", "decode-a")
        assert ray_cluster.replica_nodes("PrefillServer", nodes) == {"head"}
        assert ray_cluster.replica_nodes("DecodeServer", nodes) == {"decode-a"}
        assert _generate_all(stub, "before") == expected

        _kill_the_decode_node_mid_stream(ray_cluster, stub, "decode-a")
        _wait_health(channel, "NOT_SERVING", 60, server)
        phase("decode node killed, its streams ended, NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:  # no decode node: refused, not queued forever
            list(stub.Generate(_request("while-down", PROMPTS["r0"]), timeout=60))
        assert err.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ), err.value.details()

        # The node comes back (a new node offering the decode resource): Serve puts the decode
        # replica there again and the cluster serves exactly as before.
        ray_cluster.start_node("decode-b", {"pdserve_decode": 1})
        _wait_health(channel, "SERVING", 240, server)
        phase("a decode node back, serving")
        nodes = ("head", "decode-b")
        assert ray_cluster.replica_nodes("DecodeServer", nodes) == {"decode-b"}
        assert ray_cluster.replica_nodes("PrefillServer", nodes) == {"head"}
        assert _generate_all(stub, "after") == expected
        _check_integrity_once_idle(ray_cluster)
        phase("integrity checked")
    finally:
        channel.close()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
