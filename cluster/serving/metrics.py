"""pdserve's metrics, recorded with Ray's metrics API (exported by Ray as ``ray_pdserve_*``).

The canonical list of names lives in ``METRIC_NAMES`` (docs/api/metrics.md and Grafana use the
same). Ray appends ``_total`` to counters on export, so counters are declared without it. Tests
read the same numbers through each replica's ``stats()``, never by scraping.
"""

from __future__ import annotations

from typing import Any

from ray.util import metrics as rm

LATENCY_BUCKETS_S = [
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
PHASE_NAMES = ("router_queue", "decode_queue", "prefill_queue", "prefill", "transfer", "decode")

# Exported names (after Ray's prefix and counter suffix).
METRIC_NAMES = (
    "ray_pdserve_requests_total",
    "ray_pdserve_ttft_seconds",
    "ray_pdserve_tpot_seconds",
    "ray_pdserve_e2e_latency_seconds",
    "ray_pdserve_phase_seconds",
    "ray_pdserve_prompt_tokens_total",
    "ray_pdserve_generation_tokens_total",
    "ray_pdserve_retries_total",
    "ray_pdserve_running_requests",
    "ray_pdserve_waiting_requests",
    "ray_pdserve_kv_cache_usage",
    "ray_pdserve_prefix_cache_queried_tokens_total",
    "ray_pdserve_prefix_cache_hit_tokens_total",
    "ray_pdserve_preemptions_total",
    "ray_pdserve_prefill_decisions_total",
    "ray_pdserve_kv_transfer_bytes_total",
    "ray_pdserve_kv_transfer_blocks_total",
    "ray_pdserve_kv_transfer_seconds",
    "ray_pdserve_kv_transfer_success_total",
    "ray_pdserve_kv_transfer_failures_total",
    "ray_pdserve_kv_lease_expired_total",
    "ray_pdserve_kv_leases_active",
    "ray_pdserve_decode_streams",
    "ray_pdserve_spec_draft_tokens_total",
    "ray_pdserve_spec_accepted_tokens_total",
    "ray_pdserve_migrations_total",
    "ray_pdserve_autoscaling_decisions_total",  # recorded by serving.autoscaling on the controller
)


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = rm.Counter(
            "pdserve_requests", "Requests by API route and final status.", ("route", "status")
        )
        self.ttft = rm.Histogram(
            "pdserve_ttft_seconds", "Time to first token at the router.", LATENCY_BUCKETS_S
        )
        self.tpot = rm.Histogram(
            "pdserve_tpot_seconds", "Time per output token after the first.", LATENCY_BUCKETS_S
        )
        self.e2e = rm.Histogram(
            "pdserve_e2e_latency_seconds",
            "Request latency, arrival to last token.",
            LATENCY_BUCKETS_S,
        )
        self.phase = rm.Histogram(
            "pdserve_phase_seconds", "Per-request time by phase.", LATENCY_BUCKETS_S, ("phase",)
        )
        self.prompt_tokens = rm.Counter("pdserve_prompt_tokens", "Prompt tokens served.")
        self.generation_tokens = rm.Counter("pdserve_generation_tokens", "Tokens generated.")
        self.retries = rm.Counter("pdserve_retries", "Retries before the first token.")

    def observe_finished(
        self,
        route: str,
        status: str,
        ttft_s: float | None,
        e2e_s: float,
        completion_tokens: int,
        prompt_tokens: int,
        phases_ms: dict[str, float] | None,
    ) -> None:
        self.requests.inc(1, {"route": route, "status": status})
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))
        self.e2e.observe(e2e_s)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.inc(completion_tokens)
        for key, ms in (phases_ms or {}).items():
            phase = key.removesuffix("_ms")
            if phase in PHASE_NAMES and ms > 0:
                self.phase.observe(ms / 1000.0, {"phase": phase})


class PoolMetrics:
    """Gauges and counters of one pool replica, fed from its ``stats()`` snapshots."""

    def __init__(self, pool: str) -> None:
        tags = ("pool",)
        self.pool = pool
        self.running = rm.Gauge("pdserve_running_requests", "Requests in the batch.", tags)
        self.waiting = rm.Gauge("pdserve_waiting_requests", "Requests queued.", tags)
        self.kv_usage = rm.Gauge("pdserve_kv_cache_usage", "Share of KV blocks in use.", tags)
        self.queried = rm.Counter(
            "pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up.", tags
        )
        self.hits = rm.Counter(
            "pdserve_prefix_cache_hit_tokens", "Prompt tokens served from cache.", tags
        )
        self.preemptions = rm.Counter("pdserve_preemptions", "Preemptions (recompute).", tags)
        self.decisions = rm.Counter(
            "pdserve_prefill_decisions", "Local vs remote prefill decisions.", ("mode",)
        )
        self.bytes = rm.Counter("pdserve_kv_transfer_bytes", "KV bytes moved.", tags)
        self.blocks = rm.Counter("pdserve_kv_transfer_blocks", "KV blocks moved.", tags)
        self.transfer_s = rm.Histogram(
            "pdserve_kv_transfer_seconds", "Time of one KV pull.", LATENCY_BUCKETS_S, tags
        )
        self.success = rm.Counter("pdserve_kv_transfer_success", "Completed KV pulls.", tags)
        self.failures = rm.Counter(
            "pdserve_kv_transfer_failures", "Failed KV pulls by reason.", ("pool", "reason")
        )
        self.expired = rm.Counter("pdserve_kv_lease_expired", "Leases that expired.", tags)
        self.leases = rm.Gauge("pdserve_kv_leases_active", "Leases held.", tags)
        self.streams = rm.Gauge(
            "pdserve_decode_streams", "Decode streams in progress by stage.", ("pool", "stage")
        )
        self._stages: set[str] = set()  # every stage reported so far (gone ones read 0)
        self.spec_drafted = rm.Counter(
            "pdserve_spec_draft_tokens", "Speculative draft tokens verified.", tags
        )
        self.spec_accepted = rm.Counter(
            "pdserve_spec_accepted_tokens", "Speculative draft tokens accepted.", tags
        )
        self.migrations = rm.Counter(
            "pdserve_migrations",
            "Live migrations of decoding requests, by direction and outcome (out: moved to "
            "another decode replica; resumed: paused to move, not taken, decoded on; in: taken "
            "over from a drained replica).",
            ("pool", "outcome"),
        )
        self._last: dict[str, float] = {}

    def _delta(self, key: str, value: float) -> float:
        prev = self._last.get(key, 0.0)
        self._last[key] = value
        return max(0.0, value - prev)

    def update(self, stats: dict[str, Any]) -> None:
        tags = {"pool": self.pool}
        eng = stats.get("engine", {})
        self.running.set(eng.get("num_running", 0), tags)
        self.waiting.set(eng.get("num_waiting", 0) + eng.get("num_waiting_for_kv", 0), tags)
        self.kv_usage.set(eng.get("kv", {}).get("usage", 0.0), tags)
        for counter, key, value in (
            (self.queried, "queried", eng.get("num_prompt_tokens", 0)),
            (self.hits, "hits", eng.get("num_cached_prompt_tokens", 0)),
            (self.preemptions, "preemptions", eng.get("num_preemptions", 0)),
            (self.spec_drafted, "spec_drafted", eng.get("spec", {}).get("num_draft_tokens", 0)),
            (
                self.spec_accepted,
                "spec_accepted",
                eng.get("spec", {}).get("num_accepted_tokens", 0),
            ),
        ):
            d = self._delta(key, value)
            if d:
                counter.inc(d, tags)
        self._count_migrations(stats)
        for mode in ("local", "remote"):
            d = self._delta(f"decision_{mode}", stats.get(f"{mode}_prefills", 0))
            if d:
                self.decisions.inc(d, {"mode": mode})
        transfer = stats.get("transfer", {})
        moved = (
            (
                self.bytes,
                "bytes",
                transfer.get("bytes_sent", 0) + transfer.get("bytes_received", 0),
            ),
            (
                self.blocks,
                "blocks",
                transfer.get("blocks_sent", 0) + transfer.get("blocks_received", 0),
            ),
            (self.success, "ok", transfer.get("transfers_ok", 0)),
            (self.expired, "expired", transfer.get("leases_expired", 0)),
        )
        for counter, key, value in moved:
            d = self._delta(f"t_{key}", value)
            if d:
                counter.inc(d, tags)
        for reason, value in (transfer.get("failures") or {}).items():
            d = self._delta(f"fail_{reason}", value)
            if d:
                self.failures.inc(d, {"pool": self.pool, "reason": reason})
        self.leases.set(stats.get("num_active_leases", transfer.get("leases_active", 0)), tags)
        stages = stats.get("handoff_stages") or {}
        self._stages.update(stages)
        for stage in self._stages:
            self.streams.set(stages.get(stage, 0), {"pool": self.pool, "stage": stage})

    def _count_migrations(self, stats: dict[str, Any]) -> None:
        for outcome, key in (
            ("out", "migrated_out"),
            ("resumed", "migrations_resumed"),
            ("in", "migrated_in"),
        ):
            d = self._delta(f"migration_{outcome}", stats.get(key, 0))
            if d:
                self.migrations.inc(d, {"pool": self.pool, "outcome": outcome})

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_s.observe(seconds, {"pool": self.pool})
