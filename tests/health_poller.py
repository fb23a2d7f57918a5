"""Health latency measured from a process of its own.

A test that floods the cluster from its own threads (json-encoding MiB-sized bodies, reading
replies) holds its own GIL for tens of milliseconds at a time; a poller thread in that process
then measures the test's stalls, not the cluster's. ``HealthPoller`` polls ``/health`` and the
gRPC health service from a child process until the block ends, and hands back the latencies.

    with HealthPoller(http_url, grpc_target) as poller:
        ...  # the load
    poller.latencies["http"], poller.latencies["grpc"]

``kinds`` picks what it polls (both by default; a gRPC-only load test polls ``("grpc",)``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from types import TracebackType

PERIOD_S = 0.01


class HealthPoller:
    def __init__(
        self, http_url: str, grpc_target: str, kinds: tuple[str, ...] = ("http", "grpc")
    ) -> None:
        self.http_url = http_url
        self.grpc_target = grpc_target
        self.kinds = kinds
        self.latencies: dict[str, list[float]] = {}
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> HealthPoller:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.health_poller",
                self.http_url,
                self.grpc_target,
                ",".join(self.kinds),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        started = self._proc.stdout.readline()  # the child's first poll answered
        assert started.strip() == "polling", started
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        out, _ = self._proc.communicate("stop\n", timeout=60)
        assert self._proc.returncode == 0, self._proc.returncode
        self.latencies = json.loads(out)

    def p99(self, kind: str) -> float:
        times = sorted(self.latencies[kind])
        return times[int(0.99 * (len(times) - 1))]


def _main(http_url: str, grpc_target: str, kinds: str) -> None:
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stop = threading.Event()
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds.split(",")}
    channel = grpc.insecure_channel(grpc_target)
    health = health_pb2_grpc.HealthStub(channel)

    def check(kind: str) -> None:
        if kind == "http":
            with urllib.request.urlopen(http_url + "/health", timeout=10) as r:
                r.read()
        else:
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)

    def poll(kind: str) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            check(kind)
            latencies[kind].append(time.monotonic() - t0)
            time.sleep(PERIOD_S)

    for kind in latencies:  # connections made, outside the measurement
        check(kind)
    threads = [threading.Thread(target=poll, args=(kind,)) for kind in latencies]
    for t in threads:
        t.start()
    print("polling", flush=True)
    sys.stdin.readline()  # "stop", or EOF when the test died
    stop.set()
    for t in threads:
        t.join(30)
    channel.close()
    print(json.dumps(latencies), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3])
