"""One frozen configuration tree for every pdserve process.

Loaded once from YAML (the same file the Kubernetes ConfigMap carries) plus overrides, validated
with a ``ValueError`` that names the field, unknown keys rejected with the valid names listed.
This module is the only reader of environment variables in the package. Facts measured at run
time (how many KV blocks fit, the model's real context length) are return values of the code that
measures them, never written back here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_RUNNERS = ("torch", "fake")
_BACKENDS = ("auto", "native", "torch")


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        _fail(name, message)


def _check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, f"unknown value {value!r}; valid values: {', '.join(choices)}")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: the default model, converted once into cache_dir
    runner: str = "torch"  # model-runner registry key: torch | fake
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    num_threads: int | None = None  # torch intra-op threads of this process; None: all cores
    # CPU fp32 fast paths: native (a small C kernel for paged decode attention reading the cache
    # in place, and oneDNN linear layers at the batch sizes where a start-up probe finds them
    # faster than F.linear on this CPU), torch (plain torch ops, any device), or auto (native
    # where it applies; torch otherwise).
    kernels: str = "auto"
    seed: int = 0  # seed for requests that bring none

    def __post_init__(self) -> None:
        _check_choice(self.runner, "model.runner", _RUNNERS)
        _check_choice(self.dtype, "model.dtype", _DTYPES)
        _check_choice(self.device, "model.device", _DEVICES)
        _check_choice(self.kernels, "model.kernels", _BACKENDS)
        if self.max_model_len is not None:
            _check(self.max_model_len >= 2, "model.max_model_len", "must be >= 2")
        if self.num_threads is not None:
            _check(self.num_threads >= 1, "model.num_threads", "must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block, the same everywhere (router hashes too)
    memory_bytes: int = 1 << 30  # CPU: KV pool size in bytes
    gpu_memory_fraction: float = 0.85  # CUDA: share of the free device memory for the KV pool
    num_blocks: int | None = None  # explicit pool size, overriding the two budgets (tests)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "cache.block_size",
            f"must be a power of two >= 1, got {self.block_size}",
        )
        _check(self.memory_bytes > 0, "cache.memory_bytes", "must be > 0")
        _check(
            0.0 < self.gpu_memory_fraction <= 1.0,
            "cache.gpu_memory_fraction",
            "must be in (0, 1]",
        )
        if self.num_blocks is not None:
            _check(self.num_blocks >= 1, "cache.num_blocks", "must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step's batch
    max_num_batched_tokens: int = 2048  # tokens (prefill chunks + decodes) in one step
    chunk_size: int | None = 256  # prefill tokens per request per step; None: no chunking

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1")
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "scheduler.max_num_batched_tokens",
            f"must be >= scheduler.max_num_seqs ({self.max_num_seqs})",
        )
        if self.chunk_size is not None:
            _check(self.chunk_size >= 1, "scheduler.chunk_size", "must be >= 1 (or null)")


_TRANSPORTS = ("loopback", "shm", "zmq", "torch_dist")


@dataclass(frozen=True)
class TransferConfig:
    """kv_transfer: how KV blocks move from a prefill pool to a decode pool."""

    # Preference list, chosen per peer pair: the first that both ends support (shm needs one host).
    transports: tuple[str, ...] = ("shm", "zmq")
    bind_host: str = "127.0.0.1"  # loopback unless a multi-node config says otherwise
    advertise_host: str | None = None  # address peers dial; None: bind_host (node IP multi-node)
    lease_s: float = 30.0  # prefill side holds a request's blocks this long without a heartbeat
    heartbeat_s: float = 5.0  # decode side renews its leases this often while it waits
    transfer_timeout_s: float = 60.0  # decode side gives up a pull after this long
    max_message_bytes: int = 64 << 20  # larger frames are refused before allocation
    # KV bytes per data frame (capped by max_message_bytes): >= 64 KiB so pyzmq sends it
    # zero-copy, small enough that the receiver copies one frame while the next is in flight.
    frame_bytes: int = 8 << 20
    ipc: bool = True  # zmq over ipc:// (not tcp) when both ends share a host
    checksum: bool = False  # per-frame checksums (debugging; costs a pass over the data)
    on_failure: str = "recompute"  # recompute: prefill locally; fail: end the request
    auth: str = "none"  # none | hmac | curve (required when bind_host is not loopback)
    hmac_secret: str = ""  # or $PDSERVE_TRANSFER_SECRET
    curve_secret_key: str = ""  # z85; or $PDSERVE_CURVE_SECRET_KEY
    curve_public_key: str = ""  # z85; or $PDSERVE_CURVE_PUBLIC_KEY

    def __post_init__(self) -> None:
        _check(bool(self.transports), "transfer.transports", "must name at least one transport")
        for t in self.transports:
            _check_choice(t, "transfer.transports", _TRANSPORTS)
        for name in ("lease_s", "heartbeat_s", "transfer_timeout_s"):
            _check(getattr(self, name) > 0, f"transfer.{name}", "must be > 0")
        _check(
            self.heartbeat_s < self.lease_s,
            "transfer.heartbeat_s",
            f"must be < transfer.lease_s ({self.lease_s}) or leases expire between heartbeats",
        )
        _check(self.max_message_bytes >= 1 << 16, "transfer.max_message_bytes", "must be >= 64 KiB")
        _check(self.frame_bytes >= 1 << 16, "transfer.frame_bytes", "must be >= 64 KiB")
        _check_choice(self.on_failure, "transfer.on_failure", ("recompute", "fail"))
        _check_choice(self.auth, "transfer.auth", ("none", "hmac", "curve"))
        _check(
            self.auth != "none" or self.is_loopback_bind,
            "transfer.auth",
            f"transfer.bind_host {self.bind_host!r} is not a loopback address: set transfer.auth "
            "to hmac or curve (with its secret) before exposing the KV transfer socket",
        )

    @property
    def is_loopback_bind(self) -> bool:
        if self.bind_host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.bind_host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class FakeModelConfig:
    """The deterministic stand-in model of the ``fake`` runner (orchestration and fault tests)."""

    vocab_size: int = 512
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 16
    context_window: int = 4  # next token = f(the KV of the last context_window positions)
    prefill_delay_per_token_s: float = 0.0
    decode_delay_s: float = 0.0  # per step with at least one decode
    eos_token_id: int = 0

    def __post_init__(self) -> None:
        _check(self.vocab_size >= 16, "testing.fake_model.vocab_size", "must be >= 16")
        for name in ("num_layers", "num_kv_heads", "head_dim", "context_window"):
            _check(getattr(self, name) >= 1, f"testing.fake_model.{name}", "must be >= 1")
        _check(
            self.prefill_delay_per_token_s >= 0,
            "testing.fake_model.prefill_delay_per_token_s",
            "must be >= 0",
        )
        _check(self.decode_delay_s >= 0, "testing.fake_model.decode_delay_s", "must be >= 0")


@dataclass(frozen=True)
class TestingConfig:
    # `<name>[:n][=action]`: act the n-th time (default 1st) a worker reaches the named point.
    fault_points: tuple[str, ...] = ()
    force_preempt_interval: int = 0  # preempt the newest running request every N steps (0: off)
    fake_model: FakeModelConfig = field(default_factory=FakeModelConfig)

    def __post_init__(self) -> None:
        _check(self.force_preempt_interval >= 0, "testing.force_preempt_interval", "must be >= 0")
        for spec in self.fault_points:
            _check(bool(spec.strip()), "testing.fault_points", "entries must be non-empty")


@dataclass(frozen=True)
class RoutingConfig:
    """How a pool's Ray Serve ``RequestRouter`` picks a replica (callers of the pool run it)."""

    policy: str = "cache_aware"  # cache_aware | least_loaded | round_robin (a baseline)
    # Replicas publish their cached-block events (stored / evicted) this often.
    stats_period_s: float = 0.5
    # Scoring, in prompt-token equivalents, lowest cost first: miss_cost_factor x the prompt
    # tokens it has not cached (the request waits for that prefill, and the pool computes and
    # caches a prefix again that another replica holds), + its queued prefill tokens, +
    # queue_cost_tokens per request queued or in flight there, + (decode pool)
    # transfer_cost_per_block per prompt block it lacks. A replica with less free KV than
    # min_kv_headroom is only picked when no other one can take the request.
    miss_cost_factor: float = 2.0
    queue_cost_tokens: float = 256.0
    transfer_cost_per_block: float = 0.5
    min_kv_headroom: float = 0.05
    # The index forgets a replica's blocks it has not confirmed within this long.
    index_ttl_s: float = 30.0

    def _validate(self, name: str) -> None:
        _check_choice(
            self.policy, f"{name}.routing.policy", ("cache_aware", "least_loaded", "round_robin")
        )
        _check(self.stats_period_s > 0, f"{name}.routing.stats_period_s", "must be > 0")
        _check(self.miss_cost_factor >= 1, f"{name}.routing.miss_cost_factor", "must be >= 1")
        _check(self.queue_cost_tokens >= 0, f"{name}.routing.queue_cost_tokens", "must be >= 0")
        _check(
            self.transfer_cost_per_block >= 0,
            f"{name}.routing.transfer_cost_per_block",
            "must be >= 0",
        )
        _check(
            0 <= self.min_kv_headroom < 1, f"{name}.routing.min_kv_headroom", "must be in [0, 1)"
        )
        _check(self.index_ttl_s > 0, f"{name}.routing.index_ttl_s", "must be > 0")


@dataclass(frozen=True)
class AutoscalingConfig:
    """A pool's autoscaling policy, mapped onto Ray Serve's ``autoscaling_config`` fields.

    Prefill scales on queued prefill tokens and recent TTFT against ``ttft_slo_ms``; decode on
    KV-cache use, running sequences and recent TPOT against ``tpot_slo_ms``. Off by default: the
    pool then runs ``num_replicas`` fixed replicas.
    """

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    initial_replicas: int | None = None  # None: min_replicas
    metrics_interval_s: float = 10.0  # how often replicas report their signals
    look_back_period_s: float = 30.0  # the window the signals are averaged over
    upscale_delay_s: float = 30.0  # pressure must last this long before a scale-up
    downscale_delay_s: float = 300.0  # calm must last this long before a scale-down
    upscale_smoothing_factor: float = 1.0  # multiplies each step's change (<1: cautious)
    downscale_smoothing_factor: float = 0.5
    # Hysteresis: scale up when a signal exceeds its target, down only when every signal is
    # below scale_down_ratio x its target for the whole delay.
    scale_down_ratio: float = 0.6
    # prefill signals
    ttft_slo_ms: float = 2000.0
    target_queued_prefill_tokens: int = 8192  # per replica
    # decode signals
    tpot_slo_ms: float = 200.0
    target_kv_usage: float = 0.75  # fraction of a replica's KV blocks in use
    target_running_fraction: float = 0.75  # running sequences / max_num_seqs per replica

    def _validate(self, name: str) -> None:
        n = f"{name}.autoscaling"
        _check(self.min_replicas >= 0, f"{n}.min_replicas", "must be >= 0")
        _check(
            self.max_replicas >= max(1, self.min_replicas),
            f"{n}.max_replicas",
            f"must be >= max(1, min_replicas={self.min_replicas})",
        )
        if self.initial_replicas is not None:
            _check(
                self.min_replicas <= self.initial_replicas <= self.max_replicas,
                f"{n}.initial_replicas",
                "must lie in [min_replicas, max_replicas]",
            )
        for key in ("metrics_interval_s", "look_back_period_s", "ttft_slo_ms", "tpot_slo_ms"):
            _check(getattr(self, key) > 0, f"{n}.{key}", "must be > 0")
        for key in ("upscale_delay_s", "downscale_delay_s"):
            _check(getattr(self, key) >= 0, f"{n}.{key}", "must be >= 0")
        for key in ("upscale_smoothing_factor", "downscale_smoothing_factor"):
            _check(getattr(self, key) > 0, f"{n}.{key}", "must be > 0")
        _check(0 < self.scale_down_ratio < 1, f"{n}.scale_down_ratio", "must be in (0, 1)")
        _check(
            self.target_queued_prefill_tokens >= 1,
            f"{n}.target_queued_prefill_tokens",
            "must be >= 1",
        )
        _check(0 < self.target_kv_usage <= 1, f"{n}.target_kv_usage", "must be in (0, 1]")
        _check(
            0 < self.target_running_fraction <= 1,
            f"{n}.target_running_fraction",
            "must be in (0, 1]",
        )


@dataclass(frozen=True)
class PoolConfig:
    """One pool (prefill or decode): its replicas and the Ray Serve settings that matter."""

    num_replicas: int = 1
    num_cpus: float = 0.5  # Ray logical CPUs per replica (fractional: 2-core machines)
    num_gpus: float = 0.0  # GPUs per replica (Ray resource)
    num_threads: int | None = None  # torch threads per replica; None: model.num_threads
    scheduler: SchedulerConfig | None = None  # this pool's batching; None: the scheduler section
    max_ongoing_requests: int | None = None  # None: sized to the batch (max_num_seqs + leases)
    max_queued_requests: int = 64  # beyond this, callers get RESOURCE_EXHAUSTED / 429 at once
    graceful_shutdown_timeout_s: float = 60.0  # must exceed the KV lease plus drain time
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (multi-node)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    autoscaling: AutoscalingConfig = field(default_factory=AutoscalingConfig)

    def _validate(self, name: str) -> None:
        self.routing._validate(name)
        self.autoscaling._validate(name)
        _check(self.num_replicas >= 0, f"{name}.num_replicas", "must be >= 0")
        _check(self.num_cpus > 0, f"{name}.num_cpus", "must be > 0")
        _check(self.num_gpus >= 0, f"{name}.num_gpus", "must be >= 0")
        if self.num_threads is not None:
            _check(self.num_threads >= 1, f"{name}.num_threads", "must be >= 1")
        if self.max_ongoing_requests is not None:
            _check(self.max_ongoing_requests >= 1, f"{name}.max_ongoing_requests", "must be >= 1")
        _check(self.max_queued_requests >= 0, f"{name}.max_queued_requests", "must be >= 0")
        _check(
            self.graceful_shutdown_timeout_s > 0,
            f"{name}.graceful_shutdown_timeout_s",
            "must be > 0",
        )
        _check(self.health_check_period_s > 0, f"{name}.health_check_period_s", "must be > 0")


@dataclass(frozen=True)
class PrefillPoolConfig(PoolConfig):
    def __post_init__(self) -> None:
        self._validate("prefill")


@dataclass(frozen=True)
class DecodePoolConfig(PoolConfig):
    # A request whose uncached prompt part is at most this many tokens is prefilled locally on
    # its decode replica (no transfer); longer ones go to the prefill pool. 0: always remote.
    local_prefill_threshold: int = 64

    def __post_init__(self) -> None:
        self._validate("decode")
        _check(self.local_prefill_threshold >= 0, "decode.local_prefill_threshold", "must be >= 0")


@dataclass(frozen=True)
class RouterConfig:
    """The public edge: Ray Serve ingress, gRPC and OpenAI-compatible HTTP."""

    host: str = "127.0.0.1"  # public listeners; 0.0.0.0 only when configured (Kubernetes)
    http_port: int = 8000
    grpc_port: int = 9000
    num_replicas: int = 1
    num_cpus: float = 0.25
    max_ongoing_requests: int = 1024
    max_queued_requests: int = 256  # beyond this: RESOURCE_EXHAUSTED / HTTP 429 at once
    request_timeout_s: float = 600.0  # default deadline of a request that brings none
    max_request_bytes: int = 4 << 20  # gRPC message and HTTP body limit
    retries: int = 3  # attempts before the first token reaches the client (never after)
    assignment_timeout_s: float = 10.0  # a pool with no healthy replica answers UNAVAILABLE
    api_keys: tuple[str, ...] = ()  # empty: no authentication; or $PDSERVE_API_KEYS (comma list)
    api_keys_file: str = ""  # one key per line
    model_name: str = ""  # the OpenAI `model` name; "" -> the model directory's name

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            _check(0 < getattr(self, name) < 65536, f"router.{name}", "must be a TCP port")
        _check(self.http_port != self.grpc_port, "router.grpc_port", "must differ from http_port")
        _check(self.num_replicas >= 1, "router.num_replicas", "must be >= 1")
        _check(self.num_cpus > 0, "router.num_cpus", "must be > 0")
        _check(self.max_ongoing_requests >= 1, "router.max_ongoing_requests", "must be >= 1")
        _check(self.max_queued_requests >= 0, "router.max_queued_requests", "must be >= 0")
        _check(self.request_timeout_s > 0, "router.request_timeout_s", "must be > 0")
        _check(self.max_request_bytes >= 1024, "router.max_request_bytes", "must be >= 1024")
        _check(self.retries >= 0, "router.retries", "must be >= 0")
        _check(self.assignment_timeout_s > 0, "router.assignment_timeout_s", "must be > 0")
        for key in self.api_keys:
            _check(len(key) >= 8, "router.api_keys", "keys must be at least 8 characters")


@dataclass(frozen=True)
class PathsConfig:
    cache_dir: str = ""  # converted models and other caches; "" -> $PDSERVE_CACHE_DIR or XDG

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser()


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PrefillPoolConfig = field(default_factory=PrefillPoolConfig)
    decode: DecodePoolConfig = field(default_factory=DecodePoolConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)

    def __post_init__(self) -> None:
        sched, model = self.scheduler, self.model
        if sched.chunk_size is None and model.max_model_len is not None:
            _check(
                sched.max_num_batched_tokens >= model.max_model_len,
                "scheduler.max_num_batched_tokens",
                f"must be >= model.max_model_len ({model.max_model_len}) when chunked prefill "
                "is off (scheduler.chunk_size: null), or a long prompt could never be scheduled",
            )

        for pool in (self.prefill, self.decode):
            _check(
                pool.graceful_shutdown_timeout_s > self.transfer.lease_s,
                f"{'prefill' if pool is self.prefill else 'decode'}.graceful_shutdown_timeout_s",
                f"must exceed transfer.lease_s ({self.transfer.lease_s}), or a draining prefill "
                "replica drops leased KV",
            )

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def for_pool(self, role: str) -> ClusterConfig:
        """This config as one pool's engine sees it: the pool's scheduler and threads applied."""
        pool: PoolConfig = self.prefill if role == "prefill" else self.decode
        cfg = self
        if pool.scheduler is not None:
            cfg = dataclasses.replace(cfg, scheduler=pool.scheduler)
        if pool.num_threads is not None:
            cfg = dataclasses.replace(
                cfg, model=dataclasses.replace(cfg.model, num_threads=pool.num_threads)
            )
        return cfg

    def replace(self, overrides: Mapping[str, Any]) -> ClusterConfig:
        """A new validated config with dotted-key overrides (``{"cache.block_size": 32}``)."""
        data = self.to_dict()
        _apply_dotted(data, overrides)
        return config_from_dict(data)


# ---------------------------------------------------------------------------------------------
# Loading: YAML + overrides -> validated frozen tree


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _apply_dotted(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                valid = ", ".join(sorted(k for k, v in node.items() if isinstance(v, dict)))
                raise ValueError(f"{prefix}: unknown config section; valid sections: {valid}")
            node = child
        leaf = parts[-1]
        if leaf not in node:
            valid = ", ".join(sorted(node))
            raise ValueError(f"{dotted}: unknown config key; valid keys here: {valid}")
        node[leaf] = value


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check (and gently coerce: int -> float, list -> tuple) a YAML value against a type hint."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            _fail(name, "must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{name}: invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            _fail(name, f"must be a mapping (section), got {type(value).__name__}")
        return _build(tp, value, name)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            _fail(name, f"must be a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            _fail(name, f"must be a mapping, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp)
        return {
            _coerce(k, key_tp, name): _coerce(v, val_tp, f"{name}.{k}") for k, v in value.items()
        }
    if value is None:
        _fail(name, "must not be null")
    if tp is bool:
        if not isinstance(value, bool):
            _fail(name, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(name, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(name, f"must be a number, got {value!r}")
        if math.isnan(float(value)):
            _fail(name, "must not be NaN")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(name, f"must be a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"{name}: unsupported config type {tp!r}")  # a bug in this module


def _build(cls: Any, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"{where}{unknown[0]}: unknown config key; valid keys"
            f"{' in ' + prefix if prefix else ''}: {', '.join(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any] | None) -> ClusterConfig:
    """Validate a plain mapping (parsed YAML) into the frozen config tree."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"config: the top level must be a mapping, got {type(data).__name__}")
    cfg: ClusterConfig = _build(ClusterConfig, data, "")
    if not cfg.paths.cache_dir:
        cfg = dataclasses.replace(cfg, paths=PathsConfig(cache_dir=str(_default_cache_dir())))
    return _fill_secrets_from_env(cfg)


# Secrets may come from the environment (Kubernetes Secrets) instead of the YAML file.
_SECRET_ENV = {
    ("transfer", "hmac_secret"): "PDSERVE_TRANSFER_SECRET",
    ("transfer", "curve_secret_key"): "PDSERVE_CURVE_SECRET_KEY",
    ("transfer", "curve_public_key"): "PDSERVE_CURVE_PUBLIC_KEY",
}


def _fill_secrets_from_env(cfg: ClusterConfig) -> ClusterConfig:
    # The address peers dial for KV, per pod/node (Kubernetes: the pod IP via the downward API).
    advertise = os.environ.get("PDSERVE_ADVERTISE_HOST")
    if advertise and cfg.transfer.advertise_host is None:
        cfg = dataclasses.replace(
            cfg, transfer=dataclasses.replace(cfg.transfer, advertise_host=advertise)
        )
    keys = os.environ.get("PDSERVE_API_KEYS")
    if keys and not cfg.router.api_keys:
        parsed = tuple(k.strip() for k in keys.split(",") if k.strip())
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, api_keys=parsed))
    for (section, key), env in _SECRET_ENV.items():
        value = os.environ.get(env)
        sec = getattr(cfg, section)
        if value and not getattr(sec, key):
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sec, **{key: value})})
    return cfg


def portable_dict(cfg: ClusterConfig) -> dict[str, Any]:
    """``cfg.to_dict()`` without what came from this process's environment (secrets, the KV
    advertise address), for handing to other processes: each replica reads its own environment
    (its pod's IP and Secrets), and secrets never ride in deployment arguments."""
    d = cfg.to_dict()
    advertise = os.environ.get("PDSERVE_ADVERTISE_HOST")
    if advertise and d["transfer"]["advertise_host"] == advertise:
        d["transfer"]["advertise_host"] = None
    keys = os.environ.get("PDSERVE_API_KEYS")
    if keys:
        from_env = [k.strip() for k in keys.split(",") if k.strip()]
        if list(d["router"]["api_keys"]) == from_env:
            d["router"]["api_keys"] = []
    for (section, key), env in _SECRET_ENV.items():
        value = os.environ.get(env)
        if value and d[section][key] == value:
            d[section][key] = ""
    return d


def _default_cache_dir() -> Path:
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pdserve"


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value``, the value parsed as YAML (``16``, ``null``, ``[a, b]``)."""
    import yaml

    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r}: expected section.key=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ClusterConfig:
    """The config from a YAML file (or ``$PDSERVE_CONFIG``), with dotted-key overrides on top."""
    import yaml

    path = path if path is not None else os.environ.get("PDSERVE_CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        with p.open() as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {str(p)!r}: the top level must be a mapping")
        data = loaded or {}
    if overrides:
        full = ClusterConfig().to_dict()
        _deep_merge(full, data)
        _apply_dotted(full, overrides)
        data = full
    return config_from_dict(data)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v


_POOL_SECTIONS = ("router", "prefill", "decode")


def flat_key_index() -> dict[str, str]:
    """Leaf name -> dotted path for every leaf whose name is unique in the tree.

    Lets the offline API take ``LLM(block_size=16, max_num_seqs=8)``. The cluster sections
    (``router``, ``prefill``, ``decode``) only matter to a cluster and are left out.
    """
    seen: dict[str, list[str]] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{prefix}.{f.name}" if prefix else f.name
            if dotted in _POOL_SECTIONS:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], dotted)
            else:
                seen.setdefault(f.name, []).append(dotted)

    walk(ClusterConfig, "")
    return {name: paths[0] for name, paths in seen.items() if len(paths) == 1}


def cpu_count() -> int:
    """Cores this process may use (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
