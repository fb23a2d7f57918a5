"""One (sender, receiver) pair's 2-rank torch.distributed group and the thread that runs it.

Built on demand through a rendezvous store (never a global group), sealed when auth is on
(``rendezvous.SealedStore``). The blocking calls of a pair run in order on its own thread, each
wait with a deadline, so neither the sender's serving thread nor the receiver's I/O thread ever
blocks on a peer. A failed call aborts the group; the pair is then dead and the next pull builds
a new generation.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cluster.kv_transfer.security import StoreSealer
from cluster.kv_transfer.transports.base import Completion
from cluster.kv_transfer.transports.rendezvous import SealedStore

logger = logging.getLogger(__name__)

Job = Callable[[Any], None]  # runs on the pair thread with the process group


class DistPair:
    """One 2-rank process group and the thread that runs its blocking calls in order."""

    def __init__(
        self,
        store_factory: Callable[[], Any],
        rank: int,
        prefix: str,
        timeout_s: float,
        host: str,
        device: torch.device,
        sealer: StoreSealer | None = None,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.failed = ""
        self._jobs: queue.SimpleQueue[tuple[Job, Completion] | None] = queue.SimpleQueue()
        self._pg: Any = None
        self._build = (store_factory, prefix, host, device, sealer)
        self._thread = threading.Thread(target=self._run, name=f"kv-dist-{prefix}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Completion:
        done = Completion(pending=True)
        if self.failed:
            done.finish(False, self.failed)
        else:
            self._jobs.put((job, done))
        return done

    def abort(self, reason: str) -> None:
        """Fail the pair: queued jobs fail, a waiting job ends at its own timeout."""
        self.failed = self.failed or reason
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # best effort: an aborted or half-built group may refuse
                logger.debug("pair abort failed", exc_info=True)
        self._jobs.put(None)

    def close(self, reason: str) -> None:
        """Abort, and give the pair thread a moment to destroy its group before we go on."""
        self.abort(reason)
        self._thread.join(timeout=2.0)

    def wait(self, work: Any, deadline: float) -> None:
        remaining = max(0.001, deadline - time.monotonic())
        work.wait(datetime.timedelta(seconds=remaining))

    def _open_group(self) -> Any:
        store_factory, prefix, host, device, sealer = self._build
        # A private client connection per pair: store clients are not safe to share between
        # threads building groups at the same time.
        client = store_factory().clone()
        if sealer is not None and sealer.enabled:  # values MAC'd (S10)
            store: Any = SealedStore(client, prefix, sealer)
        else:
            store = dist.PrefixStore(prefix, client)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if device.type == "cuda":
            return dist.ProcessGroupNCCL(store, self.rank, 2, timeout=timeout)  # type: ignore[call-arg]
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, self.rank, 2, opts)

    def _run(self) -> None:
        try:
            self._pg = self._open_group()
        except Exception as e:  # e.g. a rendezvous value that fails its MAC (bad_auth)
            self.failed = self.failed or f"pair setup failed: {e}"[:300]
        while True:
            item = self._jobs.get()
            if item is None:
                break
            job, done = item
            if self.failed:
                done.finish(False, self.failed)
                continue
            try:
                job(self._pg)
                done.finish(True)
            except Exception as e:
                # A timed-out or broken collective leaves the group unusable: abort it.
                self.abort(f"{type(e).__name__}: {e}"[:300])
                done.finish(False, self.failed)
        # Destroy the group on the thread that built it, now, not during interpreter teardown
        # (a gloo group finalized late can abort the process).
        self._pg = None
        while True:  # fail whatever is still queued
            try:
                rest = self._jobs.get_nowait()
            except queue.Empty:
                return
            if rest is not None:
                rest[1].finish(False, self.failed or "pair closed")
