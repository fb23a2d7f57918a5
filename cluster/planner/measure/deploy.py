"""Arms as applications of one local Ray Serve instance, side by side or one after another.

The instance is started on the first deploy and shut down at the end; a process that already
runs Ray (a test session's shared instance) keeps it, and the arms' applications are deleted
from it at the end instead.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any


def arm_ports(configs: dict[str, Any]) -> dict[str, Any]:
    """Each arm its own gRPC port (the first arm's, then the next ones up): every Router
    replica serves gRPC itself on ``router.grpc_port``, so arms side by side cannot share one.
    A port above the first that something already listens on or holds (another process's
    connection: the first port may come from the ephemeral range) is skipped for a free one."""
    base = next(iter(configs.values())).router.grpc_port
    out: dict[str, Any] = {}
    port = base
    for i, (arm, cfg) in enumerate(configs.items()):
        if i:
            port += 1
            while not _port_free(cfg.router.host, port):
                port += 1
        out[arm] = cfg.replace({"router.grpc_port": port})
    return out


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class _LocalServe:
    """The Ray/Serve instance the arms run on: this process's own (started on the first
    deploy, shut down by ``close``) or, when Ray already runs here, that one (``shared``:
    ``close`` deletes the applications deployed and leaves it running)."""

    def __init__(self) -> None:
        import ray

        self.shared = ray.is_initialized()
        self.started = False
        self.apps: set[str] = set()

    def start_once(self, cfg: Any, deploy_app: bool) -> bool:
        """Start the instance on the first call (the router ports of ``cfg``) and, with
        ``deploy_app``, deploy ``cfg`` as the cluster's application; says whether it did."""
        from cluster.app import APP_NAME
        from cluster.serve_main import deploy, local_threads, start

        if self.started:
            return False
        # The arms share the node (side by side, or redeployed one after another while the
        # old replicas still run): none owns cores, or the first deployed would (cpu_binding).
        if not self.shared:
            start(cfg, metrics_port=None, deploy_app=deploy_app, bind_cpus=False)
        elif deploy_app:
            deploy(local_threads(cfg, bind=False))  # as start() deploys on a fresh instance
        if deploy_app:
            self.apps.add(APP_NAME)
        self.started = True
        return True

    def close(self) -> None:
        import ray
        from ray import serve

        if self.shared:
            for name in sorted(self.apps):
                serve.delete(name)
        elif self.started:
            serve.shutdown()
            ray.shutdown()


@contextlib.contextmanager
def _local_serve() -> Iterator[_LocalServe]:
    instance = _LocalServe()
    try:
        yield instance
    finally:
        instance.close()


@contextlib.contextmanager
def local_apps() -> Iterator[Callable[[str, Any], None]]:
    """Benchmark arms as Serve applications side by side: ``put(name, cfg)`` deploys (or
    redeploys) arm ``name`` beside the others (each on its own gRPC port: ``arm_ports``)."""
    from ray import serve

    from cluster.app import build_application
    from cluster.serve_main import local_threads

    with _local_serve() as instance:

        def put(name: str, cfg: Any) -> None:
            instance.start_once(cfg, False)
            app = build_application(local_threads(cfg, bind=False))  # see _LocalServe
            instance.apps.add(name)
            serve.run(app, name=name, route_prefix=f"/{name}")

        yield put


@contextlib.contextmanager
def local_cluster() -> Iterator[Callable[[Any], None]]:
    """Benchmark arms one after another: ``put(cfg)`` starts the cluster with the first arm and
    redeploys the app with each later one."""
    from cluster.serve_main import deploy

    with _local_serve() as instance:

        def put(cfg: Any) -> None:
            if not instance.start_once(cfg, True):
                deploy(cfg)

        yield put
