"""Ray Serve options of each deployment, all from the config (defaults turn a design into a toy).

``max_ongoing_requests`` sized to the batch (not Serve's default 5), ``max_queued_requests`` for a
fast RESOURCE_EXHAUSTED / 429, fractional CPUs, ``graceful_shutdown_timeout_s`` above the KV
lease, health checks, and the pools' request router.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.serve.config import RequestRouterConfig

from cluster.common.serve_routing import CACHE_AWARE_ROUTER, LEAST_LOADED_ROUTER
from cluster.config import ClusterConfig, PoolConfig


def _pool_options(pool: PoolConfig, max_ongoing: int, role: str, block_size: int) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": pool.num_cpus}
    if pool.num_gpus:
        actor["num_gpus"] = pool.num_gpus
    if pool.resources:  # node-group placement: multi-node configs only
        actor["resources"] = dict(pool.resources)
    return {
        "num_replicas": pool.num_replicas,
        "max_ongoing_requests": pool.max_ongoing_requests or max_ongoing,
        "max_queued_requests": pool.max_queued_requests,
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
        "health_check_period_s": pool.health_check_period_s,
        "health_check_timeout_s": pool.health_check_timeout_s,
        "ray_actor_options": actor,
        "request_router_config": _router_config(pool, role, block_size),
    }


def deployment_options(config: ClusterConfig) -> dict[str, dict[str, Any]]:
    """Options per deployment name (also what serveConfigV2 entries override)."""
    prefill_seqs = config.for_pool("prefill").scheduler.max_num_seqs
    decode_seqs = config.for_pool("decode").scheduler.max_num_seqs
    r = config.router
    return {
        # Prefill streams stay open while their KV is leased: room for a batch plus its leases.
        "PrefillServer": _pool_options(
            config.prefill, 2 * prefill_seqs + 8, "prefill", config.cache.block_size
        ),
        # Decode: the running batch plus requests waiting for blocks or KV.
        "DecodeServer": _pool_options(
            config.decode, 2 * decode_seqs, "decode", config.cache.block_size
        ),
        "Router": {
            "num_replicas": r.num_replicas,
            "max_ongoing_requests": r.max_ongoing_requests,
            "max_queued_requests": r.max_queued_requests,
            "ray_actor_options": {"num_cpus": r.num_cpus},
        },
    }


def _router_config(pool: PoolConfig, role: str, block_size: int) -> Any:
    """The pool's request router: cache-aware (replicas publish their cached blocks every
    ``routing.stats_period_s``) or least outstanding work."""
    routing = pool.routing
    fields: dict[str, Any] = {"request_router_class": LEAST_LOADED_ROUTER}
    if routing.policy == "cache_aware":
        fields = {
            "request_router_class": CACHE_AWARE_ROUTER,
            "request_router_kwargs": {
                "pool": role,
                "block_size": block_size,
                "routing": dataclasses.asdict(routing),
            },
            "request_routing_stats_period_s": routing.stats_period_s,
            "request_routing_stats_timeout_s": max(1.0, 4 * routing.stats_period_s),
        }
    return RequestRouterConfig(**fields)
