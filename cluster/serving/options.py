"""Ray Serve options of each deployment, all from the config (defaults turn a design into a toy).

``max_ongoing_requests`` sized to the batch (not Serve's default 5), ``max_queued_requests`` for a
fast RESOURCE_EXHAUSTED / 429, fractional CPUs, ``graceful_shutdown_timeout_s`` above the KV
lease, health checks, the pools' request router, and each pool's autoscaling (Ray Serve's
``autoscaling_config`` with pdserve's policy for that pool, when ``autoscaling.enabled``), and
the allocator settings each replica process starts with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterConfig, PoolConfig, PrefillPoolConfig, replica_allocator_env
from cluster.serving.routers import (
    CACHE_AWARE_ROUTER,
    LEAST_LOADED_ROUTER,
    ROUND_ROBIN_ROUTER,
)


def _pool_options(pool: PoolConfig, max_ongoing: int, role: str, block_size: int) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": pool.num_cpus, "runtime_env": _runtime_env(role)}
    if pool.num_gpus:
        actor["num_gpus"] = pool.num_gpus
    if pool.resources:  # node-group placement: multi-node configs only
        actor["resources"] = dict(pool.resources)
    return {
        **_replicas_options(pool),
        "max_ongoing_requests": pool.max_ongoing_requests or max_ongoing,
        "max_queued_requests": pool.max_queued_requests,
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": pool.graceful_shutdown_wait_loop_s,
        "health_check_period_s": pool.health_check_period_s,
        "health_check_timeout_s": pool.health_check_timeout_s,
        "ray_actor_options": actor,
        "request_router_config": _router_config(pool, role, block_size),
    }


def decode_max_ongoing(config: ClusterConfig) -> int:
    """Requests one decode replica takes at once: its running batch plus as many waiting for
    blocks or KV (a remote prefill in flight)."""
    seqs = config.for_pool("decode").scheduler.max_num_seqs
    return config.decode.max_ongoing_requests or 2 * seqs


def router_admission_limit(config: ClusterConfig) -> int:
    """Requests one router replica lets in at once (``router.max_ongoing_requests``, else what
    the decode pool can hold: at most this many are ever waiting on it per router replica)."""
    r = config.router
    if r.max_ongoing_requests is not None:
        return r.max_ongoing_requests
    d = config.decode
    replicas = d.autoscaling.max_replicas if d.autoscaling.enabled else max(1, d.num_replicas)
    share = -(-decode_max_ongoing(config) * replicas // r.num_replicas)  # ceil
    return share + d.max_queued_requests


def deployment_options(config: ClusterConfig) -> dict[str, dict[str, Any]]:
    """Options per deployment name (also what serveConfigV2 entries override)."""
    prefill_seqs = config.for_pool("prefill").scheduler.max_num_seqs
    r = config.router
    admitted = router_admission_limit(config)
    return {
        # Prefill streams stay open while their KV is leased: room for a batch plus its leases.
        "PrefillServer": _pool_options(
            config.prefill, 2 * prefill_seqs + 8, "prefill", config.cache.block_size
        ),
        # Decode: the running batch plus requests waiting for blocks or KV.
        "DecodeServer": _pool_options(
            config.decode, decode_max_ongoing(config), "decode", config.cache.block_size
        ),
        "Router": {
            "num_replicas": r.num_replicas,
            # Room above the router's own admission limit: the excess reaches the router and
            # gets its fast 429 instead of waiting in Serve's proxy queue.
            "max_ongoing_requests": 2 * admitted + 64,
            "max_queued_requests": r.max_queued_requests,
            "graceful_shutdown_timeout_s": r.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": r.graceful_shutdown_wait_loop_s,
            "ray_actor_options": {
                "num_cpus": r.num_cpus,
                "runtime_env": _runtime_env("router"),
                **({"resources": dict(r.resources)} if r.resources else {}),
            },
        },
    }


def _runtime_env(role: str) -> dict[str, Any]:
    """A replica's process environment: glibc's allocator tuned for long-lived, many-threaded
    servers, per role (``config.environment.replica_allocator_env`` says why)."""
    return {"env_vars": replica_allocator_env(role)}


def _router_config(pool: PoolConfig, role: str, block_size: int) -> Any:
    """The pool's request router: cache-aware (replicas publish their cached blocks every
    ``routing.stats_period_s``) or least outstanding work."""
    routing = pool.routing
    fields: dict[str, Any] = {"request_router_class": LEAST_LOADED_ROUTER}
    if routing.policy == "round_robin":
        fields = {"request_router_class": ROUND_ROBIN_ROUTER}
    elif routing.policy == "cache_aware":
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


# Import paths: Ray imports the class once (driver side, to pickle it) and instantiates it on the
# controller with policy_kwargs.
AUTOSCALING_POLICIES = {
    "prefill": "cluster.serving.autoscaling:PrefillPolicy",
    "decode": "cluster.serving.autoscaling:DecodePolicy",
}


def _replicas_options(pool: PoolConfig) -> dict[str, Any]:
    """Fixed ``num_replicas``, or (autoscaling on) Ray's ``autoscaling_config`` instead: Ray
    rejects both together."""
    if not pool.autoscaling.enabled:
        return {"num_replicas": pool.num_replicas}
    return {"autoscaling_config": autoscaling_config(pool)}


def autoscaling_config(pool: PoolConfig) -> dict[str, Any]:
    """The pool's ``autoscaling`` section as Ray Serve's ``AutoscalingConfig`` fields (a plain,
    JSON-ready dict, as a serveConfigV2 entry has it). Ray applies the delays, the scaling
    factors and the bounds to the policy's recommendation itself."""
    a = pool.autoscaling
    role = "prefill" if isinstance(pool, PrefillPoolConfig) else "decode"
    return {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "initial_replicas": a.initial_replicas,
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "upscaling_factor": a.upscale_smoothing_factor,
        "downscaling_factor": a.downscale_smoothing_factor,
        "policy": {
            "policy_function": AUTOSCALING_POLICIES[role],
            "policy_kwargs": dataclasses.asdict(a),
        },
    }
