"""``prefill`` and ``decode``: each pool's replicas, request routing and autoscaling policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from cluster.config.scheduler import SchedulerConfig
from cluster.config.speculative import SpeculativeConfig
from cluster.config.validation import check, check_choices


@dataclass(frozen=True)
class RoutingConfig:
    """How a pool's Ray Serve ``RequestRouter`` picks a replica (callers of the pool run it)."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "policy": ("cache_aware", "least_loaded", "round_robin")
    }

    policy: str = "cache_aware"
    """cache_aware: the lowest cost below (cached prefix, load, KV headroom); least_loaded: the
    least outstanding work; round_robin: each replica in turn (a baseline)."""
    stats_period_s: float = 0.5
    """Replicas publish their prefix-cache snapshot and load this often."""
    miss_cost_factor: float = 2.0
    """A candidate's cost, in prompt-token equivalents, counts each prompt token it has not
    cached this many times (the request waits for that prefill, and the pool computes and caches
    a prefix another replica may hold), plus its queued prefill tokens."""
    queue_cost_tokens: float = 256.0
    """Cost added per request queued or in flight at the candidate."""
    transfer_cost_per_block: float = 0.5
    """Decode pool: cost added per prompt block the candidate lacks (bytes that would move)."""
    min_kv_headroom: float = 0.05
    """A replica with less free KV than this share is only picked when no other can take the
    request."""
    index_ttl_s: float = 30.0
    """The index forgets a replica's blocks it has not confirmed within this long."""

    def _validate(self, name: str) -> None:
        check_choices(self, f"{name}.routing")
        check(self.stats_period_s > 0, f"{name}.routing.stats_period_s", "must be > 0")
        check(self.miss_cost_factor >= 1, f"{name}.routing.miss_cost_factor", "must be >= 1")
        check(self.queue_cost_tokens >= 0, f"{name}.routing.queue_cost_tokens", "must be >= 0")
        check(
            self.transfer_cost_per_block >= 0,
            f"{name}.routing.transfer_cost_per_block",
            "must be >= 0",
        )
        check(0 <= self.min_kv_headroom < 1, f"{name}.routing.min_kv_headroom", "must be in [0, 1)")
        check(self.index_ttl_s > 0, f"{name}.routing.index_ttl_s", "must be > 0")


@dataclass(frozen=True)
class PoolScalingConfig:
    """A pool's autoscaling policy, mapped onto Ray Serve's ``autoscaling_config`` fields.

    Prefill scales on queued prefill tokens and recent TTFT against ``ttft_slo_ms``; decode on
    KV-cache use, running sequences and recent TPOT against ``tpot_slo_ms``. Off by default: the
    pool then runs ``num_replicas`` fixed replicas.
    """

    enabled: bool = False
    """Autoscale this pool; off: ``num_replicas`` fixed replicas."""
    min_replicas: int = 1
    """The fewest replicas the policy keeps."""
    max_replicas: int = 4
    """The most replicas the policy asks for."""
    initial_replicas: int | None = None
    """Replicas at deployment; null: ``min_replicas``."""
    metrics_interval_s: float = 10.0
    """How often replicas report their signals."""
    look_back_period_s: float = 30.0
    """The window the signals are averaged over."""
    upscale_delay_s: float = 30.0
    """Pressure must last this long before a scale-up."""
    downscale_delay_s: float = 300.0
    """Calm must last this long before a scale-down."""
    upscale_smoothing_factor: float = 1.0
    """Multiplies each scale-up step's change (< 1: cautious)."""
    downscale_smoothing_factor: float = 0.5
    """Multiplies each scale-down step's change."""
    scale_down_ratio: float = 0.6
    """Hysteresis: scale up when a signal exceeds its target, down only when every signal stays
    below this share of its target for the whole delay."""
    ttft_slo_ms: float = 2000.0
    """Prefill signal: the recent TTFT target."""
    target_queued_prefill_tokens: int = 8192
    """Prefill signal: queued prompt tokens per replica."""
    tpot_slo_ms: float = 200.0
    """Decode signal: the recent TPOT target."""
    target_kv_usage: float = 0.75
    """Decode signal: the share of a replica's KV blocks in use."""
    target_running_fraction: float = 0.75
    """Decode signal: running sequences / ``max_num_seqs`` per replica."""

    def _validate(self, name: str) -> None:
        n = f"{name}.autoscaling"
        check(self.min_replicas >= 0, f"{n}.min_replicas", "must be >= 0")
        check(
            self.max_replicas >= max(1, self.min_replicas),
            f"{n}.max_replicas",
            f"must be >= max(1, min_replicas={self.min_replicas})",
        )
        if self.initial_replicas is not None:
            check(
                self.min_replicas <= self.initial_replicas <= self.max_replicas,
                f"{n}.initial_replicas",
                "must lie in [min_replicas, max_replicas]",
            )
        for key in ("metrics_interval_s", "look_back_period_s", "ttft_slo_ms", "tpot_slo_ms"):
            check(getattr(self, key) > 0, f"{n}.{key}", "must be > 0")
        for key in ("upscale_delay_s", "downscale_delay_s"):
            check(getattr(self, key) >= 0, f"{n}.{key}", "must be >= 0")
        for key in ("upscale_smoothing_factor", "downscale_smoothing_factor"):
            check(getattr(self, key) > 0, f"{n}.{key}", "must be > 0")
        check(0 < self.scale_down_ratio < 1, f"{n}.scale_down_ratio", "must be in (0, 1)")
        check(
            self.target_queued_prefill_tokens >= 1,
            f"{n}.target_queued_prefill_tokens",
            "must be >= 1",
        )
        check(0 < self.target_kv_usage <= 1, f"{n}.target_kv_usage", "must be in (0, 1]")
        check(
            0 < self.target_running_fraction <= 1,
            f"{n}.target_running_fraction",
            "must be in (0, 1]",
        )


@dataclass(frozen=True)
class PoolConfig:
    """One pool (prefill or decode): its replicas and the Ray Serve settings that matter."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"cpu_binding": ("auto", "on", "off")}

    num_replicas: int = 1
    """Replicas of the pool (when autoscaling is off); 0 in the prefill pool: colocated."""
    num_cpus: float = 0.5
    """Ray logical CPUs per replica (fractional: 2-core machines)."""
    num_gpus: float = 0.0
    """GPUs per replica (a Ray resource)."""
    num_threads: int | None = None
    """Torch threads per replica rank; null: ``model.num_threads``."""
    tensor_parallel_size: int | None = None
    """Ranks each replica's model is split across (``model.tensor_parallel_size``); null: that
    key."""
    pipeline_parallel_size: int | None = None
    """Stages each replica's layers are split across (``model.pipeline_parallel_size``); null:
    that key."""
    cpu_binding: str = "auto"
    """on: each replica binds its process to ``num_threads`` cores no other pdserve replica on
    the node holds (unbound when too few are free); off: never. auto: on where pdserve started
    Ray itself (``pdserve serve`` without ``--address``), off on a cluster it joined."""
    scheduler: SchedulerConfig | None = None
    """This pool's batching, with the keys of the ``scheduler`` section; null: that section."""
    max_ongoing_requests: int | None = None
    """Calls a replica takes at once; null: sized to the batch (max_num_seqs + leases)."""
    max_queued_requests: int = 64
    """Calls a caller queues for the pool (Serve's ``max_queued_requests``); beyond it, callers
    get RESOURCE_EXHAUSTED / 429 at once."""
    graceful_shutdown_timeout_s: float = 60.0
    """A replica going away lets its streams (leased KV included) finish for this long; must
    exceed ``transfer.lease_s``."""
    graceful_shutdown_wait_loop_s: float = 2.0
    """How often a replica going away checks that its calls have finished, after waiting this
    long once so that callers stop picking it (Serve's default: 2 s)."""
    health_check_period_s: float = 5.0
    """Ray Serve's liveness check of each replica (engine thread and KV side alive), this
    often."""
    health_check_timeout_s: float = 30.0
    """A liveness check unanswered this long fails the replica."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per replica (multi-node: pins the pool to its nodes)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """How callers of the pool pick one of its replicas."""
    autoscaling: PoolScalingConfig = field(default_factory=PoolScalingConfig)
    """The pool's autoscaling policy on Ray Serve's autoscaler."""

    def _validate(self, name: str) -> None:
        check_choices(self, name)
        self.routing._validate(name)
        self.autoscaling._validate(name)
        check(self.num_replicas >= 0, f"{name}.num_replicas", "must be >= 0")
        check(self.num_cpus > 0, f"{name}.num_cpus", "must be > 0")
        check(self.num_gpus >= 0, f"{name}.num_gpus", "must be >= 0")
        if self.num_threads is not None:
            check(self.num_threads >= 1, f"{name}.num_threads", "must be >= 1")
        if self.tensor_parallel_size is not None:
            check(self.tensor_parallel_size >= 1, f"{name}.tensor_parallel_size", "must be >= 1")
        if self.pipeline_parallel_size is not None:
            check(
                self.pipeline_parallel_size >= 1, f"{name}.pipeline_parallel_size", "must be >= 1"
            )
        if self.max_ongoing_requests is not None:
            check(self.max_ongoing_requests >= 1, f"{name}.max_ongoing_requests", "must be >= 1")
        check(self.max_queued_requests >= 0, f"{name}.max_queued_requests", "must be >= 0")
        check(
            self.graceful_shutdown_timeout_s > 0,
            f"{name}.graceful_shutdown_timeout_s",
            "must be > 0",
        )
        check(
            self.graceful_shutdown_wait_loop_s > 0,
            f"{name}.graceful_shutdown_wait_loop_s",
            "must be > 0",
        )
        check(self.health_check_period_s > 0, f"{name}.health_check_period_s", "must be > 0")


@dataclass(frozen=True)
class PrefillPoolConfig(PoolConfig):
    def __post_init__(self) -> None:
        self._validate("prefill")


@dataclass(frozen=True)
class DecodePoolConfig(PoolConfig):
    local_prefill_threshold: int = 64
    """A request whose uncached prompt part is at most this many tokens is prefilled on its
    decode replica (no transfer); longer ones go to the prefill pool. 0: always remote."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (drafts verified exactly); off by default."""
    migrate_on_drain: bool = True
    """A decode replica going away (scale-down, upgrade, ``pdserve drain``) moves its decoding
    requests to another decode replica (live migration: their KV is pulled, the client streams
    go on); off: they finish where they are, within the graceful shutdown timeout."""
    migration_claim_s: float = 3.0
    """A migrating request's KV lease must be claimed (a target replica with room starts its
    pull) within this long, or the request decodes on where it is."""

    def __post_init__(self) -> None:
        self._validate("decode")
        self.speculative._validate("decode.speculative")
        check(self.local_prefill_threshold >= 0, "decode.local_prefill_threshold", "must be >= 0")
        check(self.migration_claim_s > 0, "decode.migration_claim_s", "must be > 0")
