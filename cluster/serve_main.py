"""``pdserve serve``: start or join Ray, deploy the application, print how to call it, and shut
down cleanly on Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from cluster.config import ClusterConfig, cpu_count

CALL_HELP = """\
pdserve is up: {model}
  weights {weights}; KV cache {kv_cache}
  gRPC    {grpc}   (pdserve.v1.Generation/Generate, grpc.health.v1.Health/Check)
  HTTP    {http}   (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models)
  metrics {metrics}
Try:
  pdserve generate "What is the capital of France?"
  curl {http}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}'
Ctrl-C stops it.
"""


def local_threads(config: ClusterConfig) -> ClusterConfig:
    """On one machine, split the cores between the replicas (oversubscription is ruinous)."""
    replicas = config.prefill.num_replicas + config.decode.num_replicas
    share = max(1, (config.model.num_threads or cpu_count()) // max(1, replicas))
    overrides: dict[str, Any] = {}
    if config.prefill.num_threads is None:
        overrides["prefill.num_threads"] = share
    if config.decode.num_threads is None:
        overrides["decode.num_threads"] = share
    return config.replace(overrides) if overrides else config


def start(
    config: ClusterConfig,
    *,
    address: str | None = None,
    metrics_port: int | None = None,
    dashboard: bool = False,
    deploy_app: bool = True,
) -> Any:
    """Start Ray (or join ``address``) and Serve, deploy (unless ``deploy_app`` is False: the
    caller deploys applications of its own); returns the app handle."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from cluster.pb import GRPC_SERVICER_FUNCTIONS

    # Read by Serve's gRPC proxy when it starts (its processes inherit this environment).
    os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(config.router.max_request_bytes)
    if address:
        ray.init(address=address)
    else:
        config = local_threads(config)
        kwargs: dict[str, Any] = {"include_dashboard": dashboard}
        if dashboard:
            kwargs["dashboard_host"] = "127.0.0.1"  # never exposed by default (S7)
        if metrics_port:
            kwargs["_metrics_export_port"] = metrics_port
        ray.init(**kwargs)
    r = config.router
    serve.start(
        http_options=HTTPOptions(host=r.host, port=r.http_port),
        grpc_options=gRPCOptions(port=r.grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
    )
    return deploy(config) if deploy_app else None


def deploy(config: ClusterConfig) -> Any:
    """(Re)deploy the application on the running Serve instance; returns its handle."""
    from ray import serve

    from cluster.app import APP_NAME, build_application

    return serve.run(build_application(config), name=APP_NAME, route_prefix="/")


def serve_forever(
    config: ClusterConfig, *, address: str | None, metrics_port: int | None, dashboard: bool
) -> int:
    import ray
    from ray import serve

    from cluster.config.model import declared_formats
    from cluster.config.model_paths import model_name

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        start(config, address=address, metrics_port=metrics_port, dashboard=dashboard)
        r = config.router
        host = "127.0.0.1" if r.host in ("0.0.0.0", "::") else r.host
        print(
            CALL_HELP.format(
                model=r.model_name or model_name(config),
                **declared_formats(config.model, config.cache),
                grpc=f"{host}:{r.grpc_port}",
                http=f"http://{host}:{r.http_port}",
                metrics=f"http://127.0.0.1:{metrics_port}/metrics"
                if metrics_port and not address
                else "(Ray's metrics export port on each node)",
            ),
            flush=True,
        )
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("pdserve: shutting down", file=sys.stderr, flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
