"""Prefill side of the data plane: hold finished prefills' blocks under leases, serve pulls.

Lifecycle (one ``KVSender`` per prefill replica):
  1. ``start()`` binds one ROUTER socket (tcp on ``bind_host``, port 0, plus ipc when enabled)
     and starts the serving thread ``kv-sender``; ``endpoint`` is the real address.
  2. ``register(request_id, block_ids, num_tokens=...)`` (any thread) leases the blocks and
     returns the ``KVTransferParams`` handle to give the decode side. The caller keeps the blocks
     referenced in its engine until the release callback names the request.
  3. A receiver handshakes (layout, version, transports), heartbeats the lease while it waits,
     pulls the blocks it lacks and acks.
  4. ``on_release(request_id, reason)`` fires exactly once per lease, ON THE ``kv-sender``
     THREAD, with reason ``acked | expired | aborted | peer_aborted | closed``, and never while a
     transport may still read the blocks. The server core should only enqueue
     ``engine.release(request_id)`` for its engine thread there (the callback must not block).
  5. ``abort(request_id)`` (any thread) ends a lease early; ``close()`` releases what is left.

A streamed prompt (``register(..., streamed=True)``) is leased before its prefill ends: each
``extend`` grows the lease to the blocks computed so far (the last one, ``last=True``, seals it),
and the receiver pulls it in parts while the prefill runs; the final part's ack ends it.

The serving thread reads ``kv_cache[b]`` of leased blocks while the engine thread writes other
blocks: leased blocks are never written, so no lock is shared with the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cluster.common.faults import FaultPoints
from cluster.config import TransferConfig, advertise_host
from cluster.kv_transfer.commands import CommandQueue
from cluster.kv_transfer.framing import Buffer, Framer, InboundError, WireFaults
from cluster.kv_transfer.leases import Lease, LeaseState, LeaseTable
from cluster.kv_transfer.pool import KVPool
from cluster.kv_transfer.protocol import KVTransferError, KVTransferParams, Message, Reason
from cluster.kv_transfer.security import (
    MessageSigner,
    check_auth_config,
    host_id,
    start_server_auth,
)
from cluster.kv_transfer.sender_handlers import SenderHandlers
from cluster.kv_transfer.sockets import sender_socket
from cluster.kv_transfer.stats import TransferStats
from cluster.kv_transfer.transports import TRANSPORTS
from cluster.kv_transfer.transports.base import Completion, PeerInfo, SenderContext
from cluster.kv_transfer.transports.direct import LOCAL_POOLS

logger = logging.getLogger(__name__)

ReleaseCallback = Callable[[str, str], None]  # (request_id, reason)
_TICK_S = 0.05  # reaper / completion polling period of the serving thread


class ReleaseReason:
    ACKED = "acked"
    EXPIRED = "expired"
    ABORTED = "aborted"
    PEER_ABORTED = "peer_aborted"
    CLOSED = "closed"


class KVSender:
    def __init__(
        self,
        config: TransferConfig,
        pool: KVPool,
        *,
        on_release: ReleaseCallback,
        instance_id: str | None = None,
        epoch: int = 0,
        clock: Callable[[], float] = time.monotonic,
        fault_points: FaultPoints | None = None,
        faults: WireFaults | None = None,
        port: int = 0,  # 0: any free one; a fixed one only to restart at the same address
    ) -> None:
        check_auth_config(config)
        self.config = config
        self._port = port
        self.pool = pool
        self.instance_id = instance_id or uuid.uuid4().hex
        self.epoch = epoch
        self.clock = clock
        self.endpoint = ""
        self.ipc_endpoint = ""
        self._on_release = on_release
        self._stats = TransferStats()
        self._leases = LeaseTable(config.lease_s, clock)
        self._lock = threading.Lock()  # guards the lease table (register runs on callers)
        self._pending: dict[str, list[Completion]] = {}  # transfer_id -> reads in flight
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._commands = CommandQueue()
        self._ipc_path = ""
        self._zmq: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._zmq.linger = 0  # a dropped sender must never block in term()
        self._sock: zmq.Socket[Any] = sender_socket(self._zmq, config)
        self._auth: Any = None
        self._framer = Framer(MessageSigner.from_config(config), router=True, faults=faults)
        self._ctx = SenderContext(
            pool=pool,
            config=config,
            local=PeerInfo(self.instance_id, host_id(), os.getpid()),
            send=self._send,
            fault_points=fault_points or FaultPoints(),
            stats=self._stats,
        )
        self._handlers = SenderHandlers(self._ctx, leases=self, epoch=epoch)

    # -- caller API (any thread) --------------------------------------------------------------

    def start(self) -> str:
        sock, cfg = self._sock, self.config
        self._auth = start_server_auth(self._zmq, cfg)  # before the socket's CURVE handshakes
        sock.bind(f"tcp://{cfg.bind_host}:{self._port}")
        port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self.endpoint = f"tcp://{_advertise_host(cfg)}:{port}"
        if cfg.ipc:
            name = f"pdserve-kv-{self.instance_id[:16]}-{os.getpid()}"
            if sys.platform.startswith("linux"):
                # Abstract namespace: no file to leak when the process is killed, and reachable
                # exactly like 127.0.0.1 (same network namespace).
                self.ipc_endpoint = f"ipc://@{name}"
            else:
                self._ipc_path = os.path.join(tempfile.gettempdir(), f"{name}.sock")
                self.ipc_endpoint = f"ipc://{self._ipc_path}"
            sock.bind(self.ipc_endpoint)
        if "torch_dist" in cfg.transports:
            from cluster.kv_transfer.transports.rendezvous import start_store

            self._ctx.dist_store = start_store(cfg)
        if "loopback" in cfg.transports:
            LOCAL_POOLS[self.instance_id] = self.pool
        if "cuda_ipc" in cfg.transports and self.pool.tensor.is_cuda:
            from cluster.kv_transfer.transports.cuda_ipc import export_pool

            self._ctx.cuda_ipc = export_pool(self.pool)
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()
        return self.endpoint

    def register(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        num_tokens: int,
        block_hashes: Sequence[int] = (),
        streamed: bool = False,
        claim_s: float | None = None,
    ) -> KVTransferParams:
        """Lease ``block_ids`` (source pool ids, prompt order) for ``request_id``'s pull;
        ``streamed``: the prefill still runs, ``extend`` grows the lease until ``last``;
        ``claim_s``: it expires this soon unless a heartbeat or a pull renews it first."""
        ids = self._check_blocks(block_ids, num_tokens)
        transfer_id = uuid.uuid4().hex
        params = self._params(request_id, transfer_id, ids, num_tokens, block_hashes)
        with self._lock:
            self._leases.add(request_id, transfer_id, ids, open=streamed, first_s=claim_s)
            self._stats.set_gauge("leases_active", len(self._leases))
        self._stats.inc("leases_registered")
        return params

    def extend(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        num_tokens: int,
        block_hashes: Sequence[int] = (),
        last: bool = False,
    ) -> KVTransferParams | None:
        """Grow ``request_id``'s streamed lease to ``block_ids`` (all its blocks so far: the
        leased ones first); ``last``: the prefill is done and the final pull may end the lease.
        None when the lease already ended (its release callback has fired or will)."""
        ids = self._check_blocks(block_ids, num_tokens)
        with self._lock:
            lease = self._leases.by_request(request_id)
            if lease is None:
                return None
            if not lease.open:
                raise ValueError(f"request_id: {request_id!r}: its lease is not a growing one")
            if ids[: len(lease.block_ids)] != lease.block_ids:
                raise ValueError("block_ids: must start with the blocks already leased")
            lease.block_ids, lease.open = ids, not last
            transfer_id = lease.transfer_id
        self._stats.inc("leases_extended")
        return self._params(request_id, transfer_id, ids, num_tokens, block_hashes)

    def _check_blocks(self, block_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        ids = tuple(int(b) for b in block_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError("block_ids: must be non-empty and unique")
        if not all(0 <= b < self.pool.num_blocks for b in ids):
            raise ValueError(f"block_ids: outside the pool of {self.pool.num_blocks} blocks")
        if -(-num_tokens // self.pool.layout.block_size) > len(ids):
            raise ValueError(f"num_tokens: {num_tokens} tokens need more than {len(ids)} blocks")
        return ids

    def _params(
        self,
        request_id: str,
        transfer_id: str,
        ids: tuple[int, ...],
        num_tokens: int,
        block_hashes: Sequence[int],
    ) -> KVTransferParams:
        return KVTransferParams(
            request_id=request_id,
            transfer_id=transfer_id,
            endpoint=self.endpoint,
            ipc_endpoint=self.ipc_endpoint,
            instance_id=self.instance_id,
            epoch=self.epoch,
            host_id=self._ctx.local.host_id,
            block_ids=ids,
            block_hashes=tuple(block_hashes),
            num_tokens=num_tokens,
            layout=self.pool.layout,
        )

    def abort(self, request_id: str, reason: str = ReleaseReason.ABORTED) -> bool:
        """End ``request_id``'s lease; True if it had one. The release callback follows."""
        with self._lock:
            lease = self._leases.by_request(request_id)
        if lease is None:
            return False
        self._commands.call_soon(lambda: self.end_lease(lease, reason))
        return True

    @property
    def num_active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        return self._stats.snapshot()

    def close(self) -> None:
        """Stop serving; leases still held are released with reason ``closed``."""
        self._stopping = True
        self._commands.wake()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        else:
            self._shutdown()

    # -- serving thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._commands.fileno(), zmq.POLLIN)
        next_reap = 0.0
        while not self._stopping:
            try:
                events = dict(poller.poll(int(_TICK_S * 1000)))
                if self._sock in events:
                    self._drain_socket()
                self._commands.run_pending()
                self._poll_pending()
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + _TICK_S
                    for lease in self._expired():
                        self.end_lease(lease, ReleaseReason.EXPIRED)
            except Exception:  # the serving thread must outlive any one bad message or bug
                logger.exception("kv-sender: unexpected error; still serving")
                self._stats.inc("internal_errors")
        self._shutdown()

    def _drain_socket(self) -> None:
        for _ in range(256):  # bounded, so commands and the reaper still get their turn
            try:
                batch = self._framer.recv(self._sock)
            except zmq.Again:
                return
            except KVTransferError as e:
                self._stats.rejected(e.reason)
                refused = (Reason.BAD_VERSION, Reason.LAYOUT_MISMATCH)
                if isinstance(e, InboundError) and e.reason in refused:  # fail fast, K9
                    self._handlers.refuse_handshake(e.identity, e.reason, e.detail)
                continue
            for inbound in batch:
                self._handlers.handle(inbound)

    def _expired(self) -> list[Lease]:
        with self._lock:
            return self._leases.expired()

    def _poll_pending(self) -> None:
        for transfer_id, reads in list(self._pending.items()):
            still = []
            for done in reads:
                if not done.done():
                    still.append(done)
                elif not done.ok:
                    self._stats.failed(done.reason or "transport_error")
            if still:
                self._pending[transfer_id] = still
                continue
            del self._pending[transfer_id]
            with self._lock:
                lease = self._leases.get(transfer_id)
            if lease is None:
                continue
            if lease.state is LeaseState.DRAINING:
                self._release(lease, lease.end_reason)
            elif lease.state is LeaseState.SENDING:
                lease.state = LeaseState.SENT
                with self._lock:
                    self._leases.renew(transfer_id)  # the ack is due within one lease

    def _release(self, lease: Lease, reason: str) -> None:
        with self._lock:
            self._leases.remove(lease.transfer_id)
            self._stats.set_gauge("leases_active", len(self._leases))
        self._stats.inc("leases_released")
        self._stats.inc(f"leases_{reason}")
        try:
            self._on_release(lease.request_id, reason)
        except Exception:
            logger.exception("kv-sender: release callback raised for %s", lease.request_id)

    def _send(
        self, identity: bytes, msg: Message, frames: Sequence[Buffer], track: bool
    ) -> list[zmq.MessageTracker]:
        return self._framer.send(self._sock, msg, frames, identity=identity, track=track)

    def _shutdown(self) -> None:
        self._handlers.close()
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._zmq.term()  # drops queued frames: no transport reads the pool after this
        if self._ctx.dist_store is not None:
            self._ctx.dist_store.close()
            self._ctx.dist_store = None
        LOCAL_POOLS.pop(self.instance_id, None)
        if self._ipc_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)
        self._pending.clear()
        self._commands.run_pending()
        for lease in list(self._leases):
            self._release(lease, ReleaseReason.CLOSED)
        self._commands.close()

    # -- what the handlers call (``LeaseKeeper``, serving thread) -----------------------------

    def end_lease(self, lease: Lease, reason: str) -> None:
        """Release now, or once the lease's in-flight reads finish (serving thread)."""
        with self._lock:
            if self._leases.get(lease.transfer_id) is not lease:
                return  # already released
            if lease.transfer_id in self._pending:
                if lease.state is not LeaseState.DRAINING:
                    lease.state, lease.end_reason = LeaseState.DRAINING, reason
                return
        self._release(lease, reason)

    def track(self, transfer_id: str, done: Completion) -> None:
        self._pending.setdefault(transfer_id, []).append(done)

    def is_serving(self, transfer_id: str) -> bool:
        return transfer_id in self._pending

    def lease_for(self, transfer_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(transfer_id)

    def lease_is_finished(self, transfer_id: str) -> bool:
        with self._lock:
            return self._leases.is_finished(transfer_id)

    def renew(self, transfer_id: str) -> bool:
        with self._lock:
            return self._leases.renew(transfer_id)


def _advertise_host(config: TransferConfig) -> str:
    """The config's or the environment's advertise host, else bind_host (a wildcard resolved)."""
    host = advertise_host(config)
    if host in ("0.0.0.0", "::", "*"):
        return socket.gethostbyname(socket.gethostname())
    return host


__all__ = ["TRANSPORTS", "KVSender", "ReleaseCallback", "ReleaseReason"]
