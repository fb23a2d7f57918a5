"""``router``: the public edge (listeners, limits, retries, API keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from cluster.config.validation import check, check_choices

POOL_CALL_TRANSPORTS = ("grpc", "object_ref")


@dataclass(frozen=True)
class RouterConfig:
    """The public edge: Ray Serve ingress, gRPC and OpenAI-compatible HTTP."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"pool_call_transport": POOL_CALL_TRANSPORTS}

    host: str = "127.0.0.1"
    """The public listeners' address (HTTP and gRPC); 0.0.0.0 only when configured
    (Kubernetes). gRPC binds 0.0.0.0 dual-stack, as ``[::]``."""
    http_port: int = 8000
    """OpenAI-compatible HTTP, through Ray Serve's proxy."""
    grpc_port: int = 9000
    """gRPC: each router replica's own server (SO_REUSEPORT on one node)."""
    allow_unauthenticated: bool = False
    """A ``host`` that is not loopback without API keys is refused unless this is set (then a
    warning is printed)."""
    num_replicas: int = 1
    """Router replicas."""
    num_cpus: float = 0.25
    """Ray logical CPUs per router replica."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per replica (multi-node: pin the replicas, whose gRPC servers the
    clients dial, to the nodes a Service or load balancer points at)."""
    max_ongoing_requests: int | None = None
    """Requests in flight at one router replica (both APIs); beyond: RESOURCE_EXHAUSTED / HTTP
    429 at once, before any parsing. null: what the decode pool can hold (its replicas x their
    ``max_ongoing_requests``, shared by the router replicas, + its ``max_queued_requests``)."""
    max_queued_requests: int = 256
    """HTTP requests Serve's proxy queues for a router replica."""
    max_streams_per_connection: int = 100
    """gRPC calls open at once on one client connection."""
    ttft_slo_ms: float = 0.0
    """The time to first token a request admitted by a router replica should meet (p99): the
    replica learns from its own first tokens how TTFT grows with the prompt tokens and requests
    waiting ahead (``ttft_model`` in its stats), and refuses at once (RESOURCE_EXHAUSTED / 429,
    with the retry delay) a request predicted to start later, unless nothing is waiting. 0, the
    default: off, as in the servers users come from (a burst queues, bounded only by
    ``max_ongoing_requests``); set it to your SLO to shed load instead of queueing it."""
    max_health_watches: int = 256
    """gRPC health ``Watch`` streams open at once on a router replica; beyond, and beyond 4 on
    one connection, a ``Watch`` is refused (RESOURCE_EXHAUSTED). All watches share one poll of
    the pools' readiness, so an open watch costs a wake-up only when the status changes."""
    graceful_shutdown_timeout_s: float = 20.0
    """A router replica going away lets its calls finish for this long."""
    graceful_shutdown_wait_loop_s: float = 2.0
    """How often a replica going away checks that its calls have finished; it waits this long
    once before the first check, so the proxies stop sending to it (Serve's default: 2 s)."""
    readiness_period_s: float = 0.5
    """Health says SERVING once the pools answer a readiness probe, sent this often."""
    request_timeout_s: float = 600.0
    """The deadline of a request that brings none."""
    max_request_bytes: int = 4 << 20
    """The gRPC message and HTTP body limit."""
    max_json_schema_bytes: int = 64 << 10
    """Structured output: a JSON Schema longer than this (its JSON text) is refused (400)."""
    retries: int = 3
    """Attempts on another replica before the first token reaches the client (never after)."""
    assignment_timeout_s: float = 10.0
    """A pool call no replica accepts within this long ends UNAVAILABLE (not retried)."""
    stall_timeout_s: float = 10.0
    """A pool stream silent this long (a hung or stopped replica: no token, no keepalive, which
    replicas send every quarter of it) ends UNAVAILABLE: retried before the first token, ABORTED
    after. Also every pool call's bound, decode -> prefill included."""
    pool_call_transport: str = "grpc"
    """How the router calls the decode pool, and a decode replica the prefill pool: grpc is
    Serve's channel between replicas (a gRPC message per chunk), object_ref is Ray's actor calls
    (an object reference per chunk)."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys (>= 8 characters); empty: ``$PDSERVE_API_KEYS`` (comma-separated), read by the
    router at start; neither (nor a file): no authentication."""
    api_keys_file: str = ""
    """A file of keys, one per line, added to the keys above."""
    model_name: str = ""
    """The OpenAI ``model`` name; "": the model directory's name."""
    tls_cert_file: str = ""
    """PEM certificate: TLS on the gRPC listeners and HTTPS on Serve's proxy (with the key)."""
    tls_key_file: str = ""
    """PEM private key of ``tls_cert_file``: both or neither."""
    tls_client_ca_file: str = ""
    """PEM CA: the gRPC listener then requires client certificates it signed (mTLS; HTTP
    clients are not asked for one)."""

    def __post_init__(self) -> None:
        check_choices(self, "router")
        for name in ("http_port", "grpc_port"):
            check(0 < getattr(self, name) < 65536, f"router.{name}", "must be a TCP port")
        check(self.http_port != self.grpc_port, "router.grpc_port", "must differ from http_port")
        check(self.num_replicas >= 1, "router.num_replicas", "must be >= 1")
        check(self.num_cpus > 0, "router.num_cpus", "must be > 0")
        if self.max_ongoing_requests is not None:
            check(self.max_ongoing_requests >= 1, "router.max_ongoing_requests", "must be >= 1")
        check(self.max_queued_requests >= 0, "router.max_queued_requests", "must be >= 0")
        check(self.request_timeout_s > 0, "router.request_timeout_s", "must be > 0")
        check(self.max_json_schema_bytes >= 2, "router.max_json_schema_bytes", "must be >= 2")
        check(self.max_request_bytes >= 1024, "router.max_request_bytes", "must be >= 1024")
        check(self.retries >= 0, "router.retries", "must be >= 0")
        check(self.assignment_timeout_s > 0, "router.assignment_timeout_s", "must be > 0")
        check(self.stall_timeout_s > 0, "router.stall_timeout_s", "must be > 0")
        streams = self.max_streams_per_connection
        check(streams >= 1, "router.max_streams_per_connection", "must be >= 1")
        check(self.max_health_watches >= 1, "router.max_health_watches", "must be >= 1")
        check(self.ttft_slo_ms >= 0, "router.ttft_slo_ms", "must be >= 0 (0: off)")
        check(
            self.graceful_shutdown_timeout_s > 0,
            "router.graceful_shutdown_timeout_s",
            "must be > 0",
        )
        check(
            self.graceful_shutdown_wait_loop_s > 0,
            "router.graceful_shutdown_wait_loop_s",
            "must be > 0",
        )
        check(self.readiness_period_s > 0, "router.readiness_period_s", "must be > 0")
        check(
            bool(self.tls_cert_file) == bool(self.tls_key_file),
            "router.tls_key_file",
            "TLS needs both router.tls_cert_file and router.tls_key_file",
        )
        check(
            not self.tls_client_ca_file or bool(self.tls_cert_file),
            "router.tls_client_ca_file",
            "client certificates need TLS: set router.tls_cert_file and router.tls_key_file",
        )
        for key in self.api_keys:
            check(len(key) >= 8, "router.api_keys", "keys must be at least 8 characters")
