"""``PoolReplica``: what every pool replica (prefill or decode) is to Ray Serve, written once.

A pool deployment subclasses it, builds its role's Ray-free worker (``PrefillWorker``,
``DecodeWorker``) and adds its one streaming call. The base gives it:

  * health (``check_health``: the engine thread and the KV side are alive) and readiness
    (``ready``: that, and the pools it calls answer too);
  * introspection for operators and tests (``stats``, ``check_integrity``, ``pid``);
  * keepalives on its streams while they are quiet (``with_keepalives``: hung-replica
    detection, F10);
  * the metrics loop (``PoolMetrics`` fed from ``stats()`` every second, started with the first
    call so it runs on the replica's event loop);
  * the reports Ray Serve pulls: ``record_routing_stats`` (cached blocks and load, for the
    cache-aware request router) and ``record_autoscaling_stats`` (the pool policy's signals);
  * fault hooks (``arm_fault``, ``release_fault``, ``wait_paused``), refused unless the config
    is in test mode (``testing.enabled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, ClassVar, Protocol, TypeVar

from cluster.common.faults import FaultPoints
from cluster.config import ClusterConfig, PoolConfig
from cluster.serving.calls import KEEPALIVE, Keepalive
from cluster.serving.cpu_binding import bind_replica
from cluster.serving.heap import freeze_startup_heap, heap_stats
from cluster.serving.metrics import PoolMetrics
from cluster.serving.routing_policy import snapshot_from_stats

logger = logging.getLogger(__name__)
METRICS_PERIOD_S = 1.0
REBIND_S = 10.0  # how often an unbound replica that wants cores looks for free ones
T = TypeVar("T")
SERVE_LOGGER = "ray.serve"  # where Ray Serve writes a replica's access-log lines
QUIET_CALLS = frozenset({"ready"})  # the router's probe, every router.readiness_period_s


class QuietProbes(logging.Filter):
    """Drops Serve's access-log line of each successful readiness probe on a pool replica.

    The router asks the decode pool ``ready`` every ``router.readiness_period_s`` (0.5 s), and
    a decode replica asks the prefill pool: one line each, 170k a day per replica, burying the
    lines of real calls. A probe that failed or was cancelled is still logged, as is every
    other call. Serve writes ``[client ]METHOD ROUTE STATUS LATENCYms`` with
    ``serve_access_log`` set on the record (ray.serve._private.logging_utils.access_log_msg).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "serve_access_log", False):
            return True
        words = record.getMessage().split(" ")
        return not (len(words) >= 4 and words[-3] in QUIET_CALLS and words[-2] == "OK")


def quiet_probe_logs() -> None:
    """Install ``QuietProbes`` on Serve's logger in this process (once)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, QuietProbes) for f in serve_logger.filters):
        serve_logger.addFilter(QuietProbes())


class EngineHandle(Protocol):
    """What a replica needs of its engine (``cluster.engine.client.EngineClient``)."""

    def stats(self) -> dict[str, Any]: ...

    def check_integrity(self, timeout_s: float = ...) -> None: ...

    async def cached_block_hashes(self) -> list[int]: ...


class PoolWorker(Protocol):
    """A role's Ray-free core: its engine, its KV side, its fault points."""

    @property
    def engine(self) -> EngineHandle: ...

    @property
    def faults(self) -> FaultPoints: ...

    def is_alive(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def bind_pool_replica(
    config: ClusterConfig, role: str, *, retry: bool = False
) -> tuple[int, ...] | None:
    """Bind this replica's process to cores of its own (``<role>.cpu_binding``, see
    ``serving.cpu_binding``); call before the worker starts its threads (``retry``: a later
    attempt, see ``PoolReplica.maybe_rebind``). The cores, or None."""
    pool: PoolConfig = config.prefill if role == "prefill" else config.decode
    model = config.for_pool(role).model
    # a tensor-parallel replica's ranks each run num_threads threads, on cores of the replica's
    ranks = model.tensor_parallel_size * model.pipeline_parallel_size
    threads = model.num_threads * ranks if model.num_threads else None
    return bind_replica(role, pool.cpu_binding, threads, quiet=retry)


def serve_stopping_probe() -> Callable[[], bool] | None:
    """A check that says when Ray Serve has begun stopping this replica (scale-down, upgrade):
    Serve then waits for the open calls before it calls ``__del__``, with no hook of its own in
    between, so a replica that wants to act first (a decode replica moving its requests away)
    polls this. Reads the replica actor's own flag; None outside a Serve replica or on a Serve
    without it (then nothing acts early: calls finish within the graceful timeout, as before)."""
    try:
        from ray._private.worker import global_worker

        actor = global_worker.actors.get(global_worker.actor_id)
        impl = getattr(actor, "_replica_impl", None)
    except Exception:
        return None
    if impl is None or not isinstance(getattr(impl, "_shutting_down", None), bool):
        return None
    return lambda: bool(impl._shutting_down)


def current_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class PoolReplica:
    role: ClassVar[str]  # "prefill" | "decode": the pool's config section and metrics label
    cores: tuple[int, ...] | None = None  # the cores it is bound to (``bind_pool_replica``)

    def __init__(self, config: ClusterConfig, replica_id: str, worker: PoolWorker) -> None:
        self.config = config
        self.replica_id = replica_id
        self.worker = worker
        self.pool: PoolConfig = config.prefill if self.role == "prefill" else config.decode
        self.metrics = PoolMetrics(self.role)
        self._metrics_task: asyncio.Task[None] | None = None
        self._hashes: list[int] = []  # the engine's last answer (``record_routing_stats``)
        self._hashes_query: asyncio.Future[list[int]] | None = None
        self._next_bind = time.monotonic() + REBIND_S
        quiet_probe_logs()
        # Last: the model, the engine and the KV side are built (``serving.heap``).
        freeze_startup_heap(f"{self.role} replica {replica_id}")

    def autoscaling_signals(self, stats: dict[str, Any]) -> dict[str, float]:
        raise NotImplementedError

    def _started(self) -> None:
        """Call at the start of each request: the metrics loop needs the replica's event loop."""
        if self._metrics_task is None:
            self._metrics_task = asyncio.get_running_loop().create_task(self._publish_metrics())

    def maybe_rebind(self, now: float) -> None:
        """A replica that was to have cores of its own but found too few free (a rolling
        update's old replicas still held them, or more replicas than cores) tries again every
        ``REBIND_S``: once they are free, it takes them."""
        if self.pool.cpu_binding != "on" or self.cores is not None or now < self._next_bind:
            return
        self._next_bind = now + REBIND_S
        self.cores = bind_pool_replica(self.config, self.role, retry=True)

    async def _publish_metrics(self) -> None:
        while True:
            try:
                self.maybe_rebind(time.monotonic())
            except Exception:  # e.g. an unwritable claim file: stay unbound, keep serving
                logger.exception("%s replica: binding to cores failed", self.role)
                self._next_bind = float("inf")
            try:
                self.metrics.update(self.worker.stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("publishing %s metrics failed", self.role)
            await asyncio.sleep(METRICS_PERIOD_S)

    async def with_keepalives(self, items: AsyncIterator[T]) -> AsyncGenerator[T | Keepalive, None]:
        """``items``, with a ``Keepalive`` whenever they fall silent for a quarter of
        ``router.stall_timeout_s`` while this replica is alive: a caller tells a quiet stream
        (a request queued, a lease held) from a hung or stopped replica, which sends nothing
        (F10). Closing or cancelling this stream closes ``items`` (the request ends here)."""
        period = self.config.router.stall_timeout_s / 4
        pending: asyncio.Future[T] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(items.__anext__())
                done, _ = await asyncio.wait((pending,), timeout=period)
                if not done:
                    if self.worker.is_alive():
                        yield KEEPALIVE
                    continue
                finished, pending = pending, None
                try:
                    item = finished.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await items.aclose()  # type: ignore[attr-defined]

    # -- what Ray Serve calls ------------------------------------------------------------------

    async def record_routing_stats(self) -> dict[str, Any]:
        """Cache-aware routing: this replica's cached blocks and load (``routing_policy``).

        The block hashes come from the engine thread, between two steps. While it is inside a
        long one (a prefill of thousands of tokens takes seconds on a CPU) they are its last
        answer: the load figures are current, the cache index a step old, and Serve's
        controller does not log an error for a replica that is only busy. One question is
        asked at a time (waited for up to ``2 x routing.stats_period_s``, 1 s at least, then
        left open for the next call); a dead engine fails the call.
        """
        self.check_health()
        engine = self.worker.engine
        if self._hashes_query is None:
            self._hashes_query = asyncio.ensure_future(engine.cached_block_hashes())
            timeout_s = max(1.0, 2 * self.pool.routing.stats_period_s)
            await asyncio.wait((self._hashes_query,), timeout=timeout_s)
        if self._hashes_query.done():
            query, self._hashes_query = self._hashes_query, None
            self._hashes = query.result()
        return snapshot_from_stats(self._hashes, engine.stats())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's autoscaler reads this (the signals of the pool's policy)."""
        return self.autoscaling_signals(self.worker.stats())

    def check_health(self) -> None:
        if not self.worker.is_alive():
            raise RuntimeError(f"{self.role} replica {self.replica_id}: engine or KV side is dead")

    async def ready(self) -> bool:
        """Readiness (the router's probe): this replica can take a request now, and so can
        any pool it depends on."""
        return self.worker.is_alive() and await self.dependencies_ready()

    async def dependencies_ready(self) -> bool:
        return True

    # -- introspection -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The worker's stats plus what tests and operators ask every replica."""
        s = self.worker.stats()
        s["replica_id"] = self.replica_id
        s["paused_faults"] = self.worker.faults.paused()
        s["pid"] = os.getpid()
        s["cores"] = list(self.cores) if self.cores is not None else None
        s["kv_used_blocks"] = s["engine"]["kv"]["num_used_blocks"]  # as of the last step
        s["heap"] = heap_stats()
        return s

    def check_integrity(self) -> str:
        try:
            self.worker.engine.check_integrity()
        except AssertionError as e:
            return str(e)
        return "ok"

    def pid(self) -> int:
        return os.getpid()

    # -- fault hooks (test mode only) ----------------------------------------------------------

    def arm_fault(self, spec: str) -> str:
        """Arm a fault point for its next hit on this replica (see ``common.faults``)."""
        self.worker.faults.arm(spec)
        return self.replica_id

    def release_fault(self, name: str) -> str:
        self.worker.faults.release(name)
        return self.replica_id

    async def wait_paused(self, name: str, timeout: float) -> bool:
        return await asyncio.to_thread(self.worker.faults.wait_paused, name, timeout)

    def __del__(self) -> None:
        # Graceful shutdown: Serve has already waited for open streams (leases) to end.
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close()
