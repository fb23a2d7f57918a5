"""Decode side of the data plane: pull the blocks a request lacks straight into its reservation.

Lifecycle (one ``KVReceiver`` per decode replica):
  1. ``start()`` starts the I/O thread ``kv-receiver``; it owns every socket: one connection per
     sender incarnation (endpoint, instance id, epoch), reused by pulls and heartbeats.
  2. ``hold(params)`` (any thread): while the request waits in the decode queue, the receiver
     heartbeats its lease so the prefill side keeps the blocks.
  3. ``pull(params, dst_block_ids, first_block=k)`` (a worker thread; blocks) or ``pull_async``
     (a ``Future``): fetch source blocks ``params.block_ids[k:]`` (the first k are already
     cached here) into ``dst_block_ids`` (this request's reserved blocks, same order). Returns a
     ``PullResult`` once every block landed and verified, or raises ``KVTransferError`` with a
     reason within ``transfer_timeout_s`` (+ the transport's own bounded wind-down). On failure
     the destination blocks hold garbage and are no longer written: the caller frees (or
     recomputes into) its reservation. A partial transfer is never reported DONE.
  4. ``abort(params)`` (any thread) cancels a pull or hold and tells the sender to free.

A streamed lease (its prefill still runs) is pulled in parts: ``pull_async(params, ...,
final=False)`` fetches the blocks its handle names so far and leaves the lease held (and
heartbeated) for the rest; the last pull (``final=True``, the default) ends it.

Futures complete on the ``kv-receiver`` thread; callbacks added to them run there: keep them
short (enqueue work for the engine thread).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import zmq

from cluster.config import TransferConfig
from cluster.kv_transfer.commands import CommandQueue
from cluster.kv_transfer.framing import Framer, WireFaults
from cluster.kv_transfer.plan import check_pull_request, plan_frames
from cluster.kv_transfer.pool import KVPool
from cluster.kv_transfer.protocol import KVTransferError, KVTransferParams, Reason, TransferState
from cluster.kv_transfer.receiver_conn import PeerConnection
from cluster.kv_transfer.receiver_link import PeerLink
from cluster.kv_transfer.security import MessageSigner, check_auth_config, host_id
from cluster.kv_transfer.stats import TransferStats
from cluster.kv_transfer.transports.base import PeerInfo, ReceiverContext, RecvPull

logger = logging.getLogger(__name__)
_TICK_S = 0.02
_REMEMBERED = 1 << 14  # finished / lost transfer ids kept for state() and fast failures


@dataclass(frozen=True, slots=True)
class PullResult:
    request_id: str
    transfer_id: str
    transport: str
    num_blocks: int
    num_bytes: int
    elapsed_s: float
    state: TransferState = TransferState.DONE


class KVReceiver:
    def __init__(
        self,
        config: TransferConfig,
        pool: KVPool,
        *,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        faults: WireFaults | None = None,
    ) -> None:
        check_auth_config(config)
        self.config = config
        self.pool = pool
        self.clock = clock
        self.instance_id = instance_id or uuid.uuid4().hex
        self.stats_obj = TransferStats()
        self.rctx = ReceiverContext(
            pool, config, PeerInfo(self.instance_id, host_id(), os.getpid()), self.stats_obj, clock
        )
        self.zmq_ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.zmq_ctx.linger = 0  # a dropped receiver must never block in term()
        self.framer = Framer(MessageSigner.from_config(config), router=False, faults=faults)
        self._conns: dict[tuple[str, str, int], PeerConnection] = {}
        self._closing: list[PeerConnection] = []
        self._poller = zmq.Poller()
        self._by_socket: dict[Any, tuple[PeerConnection, bool]] = {}
        self._dst_in_use: set[int] = set()
        self._active: set[str] = set()  # transfer ids with a pull in flight
        self._states: OrderedDict[str, TransferState] = OrderedDict()
        # Leases known to be gone, with why: a later pull fails at once with that reason.
        self._lost: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._pull_ids = itertools.count(1)
        self._routing_ids = itertools.count(1)
        self._commands = CommandQueue()
        self._stopping = False
        self._next_gauges = 0.0
        self._thread: threading.Thread | None = None

    # -- caller API (any thread) --------------------------------------------------------------

    def start(self) -> None:
        self._poller.register(self._commands.fileno(), zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def pull_async(
        self,
        params: KVTransferParams,
        dst_block_ids: Sequence[int],
        *,
        first_block: int = 0,
        timeout_s: float | None = None,
        final: bool = True,
    ) -> Future[PullResult]:
        future: Future[PullResult] = Future()
        try:
            src, dst = check_pull_request(self.pool, params, dst_block_ids, first_block)
        except KVTransferError as e:
            self.stats_obj.failed(e.reason)
            future.set_exception(e)
            return future
        timeout = timeout_s if timeout_s is not None else self.config.transfer_timeout_s
        self._commands.call_soon(lambda: self._admit(params, src, dst, timeout, future, final))
        return future

    def pull(
        self,
        params: KVTransferParams,
        dst_block_ids: Sequence[int],
        *,
        first_block: int = 0,
        timeout_s: float | None = None,
        final: bool = True,
    ) -> PullResult:
        future = self.pull_async(
            params, dst_block_ids, first_block=first_block, timeout_s=timeout_s, final=final
        )
        timeout = timeout_s if timeout_s is not None else self.config.transfer_timeout_s
        try:
            return future.result(timeout=timeout + 10.0)  # the I/O thread fails it by then
        except FutureTimeout:
            raise KVTransferError(Reason.TIMEOUT, "the receiver thread did not answer") from None

    def hold(self, params: KVTransferParams) -> None:
        """Heartbeat ``params``' lease until it is pulled or aborted."""
        self._commands.call_soon(lambda: self._hold(params))

    def abort(self, params: KVTransferParams, reason: str = "aborted") -> None:
        """Cancel the pull or hold of ``params``; the sender is told to free its blocks.

        Also the way to release a lease whose blocks turned out not to be needed.
        """
        self._commands.call_soon(lambda: self._conn_for(params).abort(params.transfer_id, reason))

    def state(self, transfer_id: str) -> TransferState | None:
        return self._states.get(transfer_id)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        return self.stats_obj.snapshot()

    def close(self) -> None:
        self._stopping = True
        self._commands.wake()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    # -- I/O thread ---------------------------------------------------------------------------

    def _admit(
        self,
        params: KVTransferParams,
        src: tuple[int, ...],
        dst: tuple[int, ...],
        timeout: float,
        future: Future[PullResult],
        final: bool = True,
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it started; once started, cancel with abort(params)
        tid = params.transfer_id
        error = None
        if tid in self._lost:
            error = KVTransferError(*self._lost[tid])
        elif tid in self._active:
            error = KVTransferError(Reason.DUPLICATE, "a pull of this transfer is in flight")
        elif not self._dst_in_use.isdisjoint(dst):
            busy = sorted(self._dst_in_use.intersection(dst))[:8]
            error = KVTransferError(
                Reason.BAD_DESTINATION, f"blocks {busy} are being filled by another pull"
            )
        if error is not None:
            self.stats_obj.failed(error.reason)
            future.set_exception(error)
            return
        now = self.clock()
        cfg = self.config
        plan = plan_frames(src, dst, self.pool.bytes_per_block, cfg.max_frame_bytes)
        pull = RecvPull(
            pull_id=next(self._pull_ids),
            params=params,
            src_ids=src,
            dst_ids=dst,
            plan=plan,
            checksum=cfg.checksum,
            started=time.perf_counter(),
            deadline=now + timeout,
            future=future,
            final=final,
        )
        self._dst_in_use.update(dst)
        self._active.add(tid)
        self._remember(tid, TransferState.PENDING)
        self._conn_for(params).add_pull(pull)

    def _hold(self, params: KVTransferParams) -> None:
        if params.transfer_id not in self._lost:
            self._conn_for(params).holds[params.transfer_id] = params

    def _conn_for(self, params: KVTransferParams) -> PeerConnection:
        conn = self._conns.get(params.peer_key)
        if conn is None:
            conn = PeerConnection(self, params)
            self._conns[params.peer_key] = conn
            self.stats_obj.inc("connections_opened")
        return conn

    # -- what the connections call (``ConnectionOwner``, I/O thread) --------------------------

    def open_link(self, endpoint: str) -> PeerLink:
        routing_id = f"{self.instance_id[:16]}-{next(self._routing_ids)}".encode()
        return PeerLink(self.zmq_ctx, self.config, self.framer, routing_id, endpoint)

    def watch(self, conn: PeerConnection) -> None:
        link = conn.link
        self._by_socket[link.sock] = (conn, False)
        self._by_socket[link.monitor] = (conn, True)
        self._poller.register(link.sock, zmq.POLLIN)
        self._poller.register(link.monitor, zmq.POLLIN)

    def unwatch(self, conn: PeerConnection) -> None:
        for sock in (conn.link.sock, conn.link.monitor):
            if self._by_socket.pop(sock, None) is not None:
                self._poller.unregister(sock)

    def finish_ok(self, pull: RecvPull) -> None:
        # A part of a streamed lease: the transfer goes on (the connection holds it again).
        state = TransferState.DONE if pull.final else TransferState.TRANSFERRING
        self._release(pull, state)
        elapsed = time.perf_counter() - pull.started
        plan = pull.plan
        self.stats_obj.inc("transfers_ok" if pull.final else "parts_ok")
        self.stats_obj.inc("blocks_received", plan.num_blocks)
        self.stats_obj.inc("bytes_received", plan.num_bytes)
        self.stats_obj.observe("transfer_time_s", elapsed)
        result = PullResult(
            pull.params.request_id,
            pull.params.transfer_id,
            pull.transport,
            plan.num_blocks,
            plan.num_bytes,
            elapsed,
            state,
        )
        if not pull.future.done():
            pull.future.set_result(result)

    def finish_failed(self, pull: RecvPull, reason: str, message: str) -> None:
        self._release(pull, TransferState.FAILED)
        self.stats_obj.failed(reason)
        if not pull.future.done():
            pull.future.set_exception(KVTransferError(reason, message))

    def mark_lost(self, transfer_id: str, reason: str, message: str) -> None:
        self._lost[transfer_id] = (reason, message)
        if len(self._lost) > _REMEMBERED:
            self._lost.popitem(last=False)
        self.stats_obj.inc("leases_lost")

    # -- I/O thread: bookkeeping and the loop -------------------------------------------------

    def _release(self, pull: RecvPull, state: TransferState) -> None:
        self._dst_in_use.difference_update(pull.dst_ids)
        self._active.discard(pull.params.transfer_id)
        self._remember(pull.params.transfer_id, state)

    def _remember(self, transfer_id: str, state: TransferState) -> None:
        self._states[transfer_id] = state
        self._states.move_to_end(transfer_id)
        if len(self._states) > _REMEMBERED:
            self._states.popitem(last=False)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:  # the I/O thread must outlive any one bad message or bug
                logger.exception("kv-receiver: unexpected error; still serving")
                self.stats_obj.inc("internal_errors")
        self._shutdown()

    def _step(self) -> None:
        busy = any(c.pulls or c.waiting or c.failing for c in self._conns.values())
        events = self._poller.poll(int((_TICK_S if busy else 2.5 * _TICK_S) * 1000))
        commands = False
        for sock, _ in events:
            if sock == self._commands.fileno():
                commands = True
                continue
            entry = self._by_socket.get(sock)
            if entry is not None:
                conn, is_monitor = entry
                conn.on_monitor() if is_monitor else conn.on_readable()
        if commands:  # every call_soon writes the pipe, so none waits past this poll
            self._commands.run_pending()
        now = self.clock()
        for conn in [*self._conns.values(), *self._closing]:
            conn.tick(now)
        self._gc_connections(now)
        if now >= self._next_gauges:  # once a tick, not on every message of every pull
            self._next_gauges = now + _TICK_S
            stats = self.stats_obj
            stats.set_gauge("connections_active", len(self._conns))
            stats.set_gauge("pulls_active", len(self._active))
            stats.set_gauge("leases_held", sum(len(c.holds) for c in self._conns.values()))

    def _gc_connections(self, now: float) -> None:
        idle_after = 2 * self.config.lease_s
        for key, conn in list(self._conns.items()):
            if conn.state == conn.FAILED or (not conn.busy and now - conn.last_active > idle_after):
                del self._conns[key]
                self._closing.append(conn)
        for conn in list(self._closing):
            if not conn.failing:
                self._closing.remove(conn)
                self._forget(conn)

    def _forget(self, conn: PeerConnection) -> None:
        conn.close()

    def _shutdown(self) -> None:
        self._commands.run_pending()
        for conn in [*self._conns.values(), *self._closing]:
            conn.fail(Reason.CLOSED, "the receiver is closing")
            for pull, _done, reason, message in conn.failing:
                self.finish_failed(pull, reason, message)
            conn.failing = []
            self._forget(conn)
        self._conns.clear()
        self._closing.clear()
        self.zmq_ctx.term()
        self._commands.close()
