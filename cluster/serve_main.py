"""``pdserve serve``: start or join Ray, deploy the application, print how to call it, and shut
down cleanly on Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
from typing import Any

from cluster.config import ClusterConfig, RouterConfig, cpu_count, ray_auth_disabled
from cluster.router.auth import check_exposure

logger = logging.getLogger(__name__)

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


def local_threads(config: ClusterConfig, *, bind: bool = True) -> ClusterConfig:
    """On one machine, split the cores between the replicas (oversubscription is ruinous),
    and (``bind``) bind each replica to its share: ``cpu_binding: auto`` -> on, no other tenant
    here. Benchmarks that run several apps on one node pass ``bind=False``: no app owns cores."""
    # every rank of a tensor-parallel replica runs the share (its pool's threads per rank)
    ranks = sum(
        config.for_pool(role).model.tensor_parallel_size
        * config.for_pool(role).model.pipeline_parallel_size
        * pool.num_replicas
        for role, pool in (("prefill", config.prefill), ("decode", config.decode))
    )
    cores = config.model.num_threads or cpu_count()
    share = max(1, cores // max(1, ranks))
    if ranks > cores:
        logger.warning(
            "%d replica ranks (tensor parallelism included) on %d cores: each gets one thread, "
            "more threads than cores",
            ranks,
            cores,
        )
    overrides: dict[str, Any] = {}
    for role, pool in (("prefill", config.prefill), ("decode", config.decode)):
        if pool.num_threads is None:
            overrides[f"{role}.num_threads"] = share
        if bind and pool.cpu_binding == "auto":
            overrides[f"{role}.cpu_binding"] = "on"
    return config.replace(overrides) if overrides else config


def start(
    config: ClusterConfig,
    *,
    address: str | None = None,
    metrics_port: int | None = None,
    dashboard: bool = False,
    deploy_app: bool = True,
    checked: bool = False,
    bind_cpus: bool = True,
) -> Any:
    """Start Ray (or join ``address``) and Serve, deploy (unless ``deploy_app`` is False: the
    caller deploys applications of its own); returns the app handle. Public listeners without
    API keys are refused first (``checked``: the caller did it). ``bind_cpus``: see
    ``local_threads``."""
    import ray
    from ray import serve

    if not checked:
        warning = check_exposure(config.router)  # before anything starts: ValueError
        if warning:
            print(f"pdserve: {warning}", file=sys.stderr, flush=True)
    if address:
        ray.init(address=address)
    else:
        config = local_threads(config, bind=bind_cpus)
        # Ray's own control plane (GCS, raylets, the job API on the dashboard agent) refuses
        # callers without the cluster's token (S7): Ray's default since 2.52.
        if ray_auth_disabled():
            print(
                "pdserve: WARNING: RAY_AUTH_MODE=disabled: Ray's job API takes jobs from anyone "
                "who can reach this machine",
                file=sys.stderr,
            )
        kwargs: dict[str, Any] = {"include_dashboard": dashboard}
        if dashboard:
            kwargs["dashboard_host"] = "127.0.0.1"  # never exposed by default (S7)
        if metrics_port:
            kwargs["_metrics_export_port"] = metrics_port
        ray.init(**kwargs)
    # HTTP through Serve's proxy, on router.host only; gRPC is each Router replica's own server
    # (router/grpc_server.py): Serve's gRPC proxy would listen on every interface.
    serve.start(http_options=http_options(config.router))
    return deploy(config) if deploy_app else None


def http_options(r: RouterConfig) -> Any:
    """Serve's HTTP proxy on ``router.host``; HTTPS when ``router.tls_*`` name a certificate."""
    from ray.serve.config import HTTPOptions

    tls: dict[str, Any] = {}
    if r.tls_cert_file:
        tls = {"ssl_certfile": r.tls_cert_file, "ssl_keyfile": r.tls_key_file}
    return HTTPOptions(host=r.host, port=r.http_port, **tls)


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
    # `kill -USR1 <pid>` prints every thread's stack (a shutdown that hangs says where).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    warning = check_exposure(config.router)  # refused: nothing starts (ValueError)
    if warning:
        print(f"pdserve: {warning}", file=sys.stderr, flush=True)
    if not address:  # a Ray of our own: a SIGKILLed launcher must not leave it running (F13)
        from cluster import launcher_guard

        launcher_guard.start()
    try:
        start(config, address=address, metrics_port=metrics_port, dashboard=dashboard, checked=True)
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
        # Ctrl-C now sets the event, like SIGTERM, and the wait wakes up to look: a signal the
        # kernel hands to one of Ray's or gRPC's threads does not interrupt a blocked wait(),
        # and its Python handler runs only once the main thread runs again.
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:  # Ctrl-C while starting
        pass
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C hurries it
        print("pdserve: shutting down", file=sys.stderr, flush=True)
        if ray.is_initialized():  # serve.shutdown() alone would start a Ray to shut down
            try:
                serve.shutdown()
                print("pdserve: Serve stopped", file=sys.stderr, flush=True)
            finally:
                ray.shutdown()
                print("pdserve: Ray stopped", file=sys.stderr, flush=True)
    return 0


def drain_decode_replica(
    replica_id: str | None, *, address: str, app_name: str, timeout_s: float = 60.0
) -> int:
    """``pdserve drain``: ask the named decode replica of a running cluster to move its decoding
    requests to the other decode replicas (live migration) and stop taking calls. Without a
    replica id, lists the pool's replicas. The pool's router picks who answers each call, so
    this asks until the named one did (or ``timeout_s``)."""
    import logging
    import time

    import ray
    from ray import serve

    try:
        ray.init(
            address=address,
            log_to_driver=False,
            logging_level=logging.ERROR,
            ignore_reinit_error=True,
        )
    except (ConnectionError, RuntimeError) as e:
        raise ValueError(f"--address {address!r}: no Ray cluster answered ({e})") from None
    try:
        handle = serve.get_deployment_handle("DecodeServer", app_name)
    except Exception as e:  # no such application, or Serve not running there
        raise ValueError(
            f"--app {app_name!r}: no pdserve decode pool in that Ray cluster "
            f"({type(e).__name__}: {e})"
        ) from None
    deadline = time.monotonic() + timeout_s
    if replica_id is None:
        seen: dict[str, dict[str, Any]] = {}
        listing_until = time.monotonic() + 3.0  # calls spread over the replicas meanwhile
        while not seen or time.monotonic() < listing_until:
            info = handle.replica_info.remote().result(timeout_s=timeout_s)
            seen[info["replica_id"]] = info
        for info in seen.values():
            print(
                f"{info['replica_id']}  running {info['running']}"
                f"{'  (draining)' if info['draining'] else ''}"
            )
        print("pdserve drain --replica ID: moves that replica's requests to the others")
        return 0
    while time.monotonic() < deadline:
        out = handle.drain.remote(replica_id).result(timeout_s=timeout_s)
        if out["drained"]:
            print(
                f"decode replica {replica_id} is draining: {out['migrating']} decoding requests "
                f"moving to the other replicas, {out['staying']} finishing where they are"
            )
            return 0
    raise ValueError(f"--replica: no decode replica {replica_id!r} answered within {timeout_s:g} s")
