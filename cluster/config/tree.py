"""``ClusterConfig``: the root of the frozen tree, and the checks that span its sections."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.config.model import CacheConfig, ModelConfig
from cluster.config.paths import PathsConfig
from cluster.config.pools import DecodePoolConfig, PoolConfig, PrefillPoolConfig
from cluster.config.router import RouterConfig
from cluster.config.scheduler import SchedulerConfig
from cluster.config.schema import apply_dotted, build_dataclass, to_plain
from cluster.config.structured import StructuredConfig
from cluster.config.testing import TestingConfig
from cluster.config.transfer import TransferConfig
from cluster.config.validation import check


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model runs, on what, in which weight format."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The paged KV cache of each engine: block size, budget, dtype, prefix caching."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The batch one engine step may build (a pool may override it: ``prefill.scheduler``,
    ``decode.scheduler``)."""
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """How KV blocks move from a prefill pool to a decode pool: transports, leases, auth."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The public edge: listeners, limits, retries, API keys, TLS."""
    prefill: PrefillPoolConfig = field(default_factory=PrefillPoolConfig)
    """The prefill pool: replicas, Ray resources, routing, autoscaling."""
    decode: DecodePoolConfig = field(default_factory=DecodePoolConfig)
    """The decode pool: as ``prefill``, plus the local-prefill threshold and speculative
    decoding."""
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    """Grammar-constrained decoding (JSON Schema) in the pools' engines."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Where pdserve keeps what it converts and caches."""
    testing: TestingConfig = field(default_factory=TestingConfig)
    """Test mode: fault points, forced preemption, the fake runner's model."""

    def __post_init__(self) -> None:
        sched, model = self.scheduler, self.model
        if sched.chunk_size is None and model.max_model_len is not None:
            check(
                sched.max_num_batched_tokens >= model.max_model_len,
                "scheduler.max_num_batched_tokens",
                f"must be >= model.max_model_len ({model.max_model_len}) when chunked prefill "
                "is off (scheduler.chunk_size: null), or a long prompt could never be scheduled",
            )

        for pool in (self.prefill, self.decode):
            check(
                pool.graceful_shutdown_timeout_s > self.transfer.lease_s,
                f"{'prefill' if pool is self.prefill else 'decode'}.graceful_shutdown_timeout_s",
                f"must exceed transfer.lease_s ({self.transfer.lease_s}), or a draining prefill "
                "replica drops leased KV",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists for tuples), safe to hand to other processes: the tree holds only
        what the YAML and overrides said, never values from this process's environment."""
        return to_plain(self)

    def for_pool(self, role: str) -> ClusterConfig:
        """This config as one pool's engine sees it: the pool's scheduler, threads and tensor
        parallelism applied."""
        pool: PoolConfig = self.prefill if role == "prefill" else self.decode
        cfg = self
        if pool.scheduler is not None:
            cfg = dataclasses.replace(cfg, scheduler=pool.scheduler)
        model = cfg.model
        if pool.num_threads is not None:
            model = dataclasses.replace(model, num_threads=pool.num_threads)
        if pool.tensor_parallel_size is not None:
            model = dataclasses.replace(model, tensor_parallel_size=pool.tensor_parallel_size)
        if pool.pipeline_parallel_size is not None:
            model = dataclasses.replace(model, pipeline_parallel_size=pool.pipeline_parallel_size)
        return dataclasses.replace(cfg, model=model) if model is not cfg.model else cfg

    def replace(self, overrides: Mapping[str, Any]) -> ClusterConfig:
        """A new validated config with dotted-key overrides (``{"cache.block_size": 32}``)."""
        data = self.to_dict()
        apply_dotted(data, overrides)
        cfg: ClusterConfig = build_dataclass(type(self), data, "")
        return cfg
