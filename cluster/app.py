"""The Ray Serve application: Router (ingress) -> DecodeServer pool -> PrefillServer pool.

``build_app`` is the import path Ray Serve and KubeRay use (``cluster.app:build_app``, with
``args: {config_path: ..., overrides: {...}}``); ``build_application(config)`` is what
``pdserve serve`` calls. Every Ray Serve option that matters comes from the config here:
``max_ongoing_requests`` sized to the batch (not Serve's default 5), ``max_queued_requests`` for
a fast RESOURCE_EXHAUSTED / 429, fractional CPUs, ``graceful_shutdown_timeout_s`` above the KV
lease, health checks, and the pools' request router.
"""

from __future__ import annotations

from typing import Any

from cluster.config import ClusterConfig, load_config
from cluster.decode_worker.deployment import DecodeServer
from cluster.prefill_worker.deployment import PrefillServer
from cluster.router.ingress import Router
from cluster.serving.options import deployment_options

APP_NAME = "pdserve"


def _deployment(cls: Any) -> Any:
    # @serve.deployment turns the class into a Deployment; its stubs do not say so.
    return cls


def build_application(config: ClusterConfig) -> Any:
    opts = deployment_options(config)
    plain = config.to_dict()  # no secrets or pod IP: each replica reads its own environment
    prefill = None
    if config.prefill.num_replicas > 0:  # 0: a colocated cluster (every prefill is local)
        prefill = _deployment(PrefillServer).options(**opts["PrefillServer"]).bind(plain)
    decode = _deployment(DecodeServer).options(**opts["DecodeServer"]).bind(plain, prefill)
    return _deployment(Router).options(**opts["Router"]).bind(plain, decode)


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve / KubeRay entry point: ``args = {config_path, overrides}`` (both optional)."""
    unknown = sorted(set(args) - {"config_path", "overrides"})
    if unknown:
        raise ValueError(f"app args: unknown {unknown}; valid: config_path, overrides")
    config = load_config(args.get("config_path"), args.get("overrides") or None)
    return build_application(config)
