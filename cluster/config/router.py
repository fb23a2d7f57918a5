"""``router``: the public edge (listeners, limits, retries, API keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config.validation import check

POOL_CALL_TRANSPORTS = ("grpc", "object_ref")


@dataclass(frozen=True)
class RouterConfig:
    """The public edge: Ray Serve ingress, gRPC and OpenAI-compatible HTTP."""

    host: str = "127.0.0.1"  # public listeners; 0.0.0.0 only when configured (Kubernetes)
    http_port: int = 8000
    grpc_port: int = 9000  # each router replica's own gRPC server (SO_REUSEPORT on one node)
    # A host that is not loopback without API keys is refused unless this is set (a warning).
    allow_unauthenticated: bool = False
    num_replicas: int = 1
    num_cpus: float = 0.25
    # Custom Ray resources per replica (multi-node: pin the replicas, whose gRPC servers the
    # clients dial, to the nodes a Service or load balancer points at).
    resources: dict[str, float] = field(default_factory=dict)
    # Requests in flight at one router replica (both APIs); beyond: RESOURCE_EXHAUSTED / HTTP
    # 429 at once, before any parsing. None: what the decode pool can hold (its replicas x
    # their max_ongoing_requests, shared by the router replicas, + its max_queued_requests).
    max_ongoing_requests: int | None = None
    max_queued_requests: int = 256  # HTTP requests Serve's proxy queues for a router replica
    max_streams_per_connection: int = 100  # gRPC calls open at once on one client connection
    graceful_shutdown_timeout_s: float = 20.0  # a router replica going away lets calls finish
    # How often a replica going away checks that its calls have finished; it waits this long
    # once before the first check, so the proxies stop sending to it (Serve's default: 2 s).
    graceful_shutdown_wait_loop_s: float = 2.0
    # Health says SERVING once the pools answer a readiness probe, sent this often.
    readiness_period_s: float = 0.5
    request_timeout_s: float = 600.0  # default deadline of a request that brings none
    max_request_bytes: int = 4 << 20  # gRPC message and HTTP body limit
    # Structured output: a JSON Schema longer than this (its JSON text) is refused (400).
    max_json_schema_bytes: int = 64 << 10
    retries: int = 3  # attempts before the first token reaches the client (never after)
    assignment_timeout_s: float = 10.0  # a pool with no healthy replica answers UNAVAILABLE
    # A pool stream silent this long (a hung or SIGSTOPped replica: no token, no keepalive,
    # which replicas send every quarter of it) ends UNAVAILABLE: retried before the first token,
    # ABORTED after. Also every pool call's bound, decode -> prefill included.
    stall_timeout_s: float = 10.0
    # How the router calls the decode pool, and a decode replica the prefill pool: "grpc" is
    # Serve's channel between replicas (each chunk a gRPC message; the caller spent 0.37 ms of
    # CPU per chunk against 0.59 ms for "object_ref"), "object_ref" is Ray's actor calls, an
    # object reference per chunk.
    pool_call_transport: str = "grpc"
    # Empty: $PDSERVE_API_KEYS (comma list), read by the router at start; neither: no auth.
    api_keys: tuple[str, ...] = ()
    api_keys_file: str = ""  # one key per line, added to the keys above
    model_name: str = ""  # the OpenAI `model` name; "" -> the model directory's name
    # TLS on the public listeners (PEM files): both or neither; a client CA makes the gRPC
    # listener require client certificates (mTLS; HTTP clients are not asked for one).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""

    def __post_init__(self) -> None:
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
        check(
            self.pool_call_transport in POOL_CALL_TRANSPORTS,
            "router.pool_call_transport",
            f"must be one of {', '.join(POOL_CALL_TRANSPORTS)}",
        )
        streams = self.max_streams_per_connection
        check(streams >= 1, "router.max_streams_per_connection", "must be >= 1")
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
