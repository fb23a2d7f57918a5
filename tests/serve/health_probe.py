"""Health checks from a process of its own while a test loads the router
(``python -m tests.serve.health_probe TARGET``).

A poller thread inside the test's process would share the GIL with the load's own asyncio
client and measure that client's stalls too. This one prints READY once connected, calls
``grpc.health.v1.Health/Check`` every 10 ms until its stdin closes, and prints one JSON line:
the seconds of each check.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(target: str) -> None:
    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    grpc.channel_ready_future(channel).result(timeout=30)
    done = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    print("READY", flush=True)
    out: list[float] = []
    while not done.is_set():
        t0 = time.perf_counter()
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        out.append(time.perf_counter() - t0)
        done.wait(0.01)
    channel.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
