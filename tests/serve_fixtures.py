"""One local Ray + Serve instance per pytest session (apps are deployed and deleted per test)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServeCluster:
    """The session's Ray + Serve: the HTTP proxy's port (each app's router replicas serve gRPC
    on their own ``router.grpc_port``)."""

    http_port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    cluster = ServeCluster(free_port())
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=cluster.http_port))
    # serve.start returns before the HTTP proxy actor has started. A proxy still importing its
    # web stack when the first test computes references on both cores misses its start-up
    # deadline, and Serve kills it under the deploy that waits for it (ActorDiedError: seen).
    assert wait_until(lambda: _proxy_answers(cluster.http_url), timeout=120), "no Serve proxy"
    try:
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()


def _proxy_answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:  # any answer, 503 "route table not populated" (no app yet) included
        with urllib.request.urlopen(url + "/-/healthz", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def wait_until(predicate: Any, timeout: float = 30.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
