"""The decode pool's core (Ray-free): an engine in the decode role and a KV receiver.

The decode replica owns each request's prefill/decode hand-off (``generate(call)`` streams; one
``RequestHandoff`` per request, in ``request_handoff``):
  1. The request joins the engine, which matches its own prefix cache and decides: if the
     uncached part of the prompt is at most ``decode.local_prefill_threshold`` tokens (or no
     prefill pool is reachable) it prefills locally with chunked prefill; otherwise remote.
  2. Remote: the request waits in the engine for KV; the engine reserves its blocks (its own
     cached prefix first), and only then is the prefill pool called: a prefill replica never
     holds KV that has nowhere to go (two full pools cannot deadlock).
  3. The prefill reply brings the first token (with n > 1 and a full last prompt block, each
     sample's), its text and logprobs: it is streamed at once, from the reply (TTFT waits for
     neither the transfer nor this engine's step). Its lease is heartbeated until the pull.
  4. Only the blocks not cached here are pulled, straight into the reserved blocks; the pull's
     ack frees the prefill side. Then the engine's second and last entry, ``kv_arrived``, hands
     it the first tokens (it takes them in without an output) and the request decodes in the
     continuous batch. A first token that ended the request skips the pull, not the entry.
  5. A failed prefill call or pull: recompute locally (``transfer.on_failure: recompute``, exact
     thanks to seeded sampling) or end with an error. Cancelling the stream aborts the request
     here, the pull, and the prefill call. Deadlines end the request with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import torch

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.faults import FaultPoints
from cluster.common.kv_layout import KVLayout
from cluster.common.protocol import GenerateCall, Migrating, StreamChunk
from cluster.config import ClusterConfig
from cluster.decode_worker.migration import Departures
from cluster.decode_worker.request_handoff import DecodeContext, PrefillClient, RequestHandoff
from cluster.engine.client import EngineClient
from cluster.engine.engine import LLMEngine
from cluster.engine.runner_registry import create_runner
from cluster.kv_transfer import KVPool, KVReceiver, KVSender
from cluster.serving.signals import RecentWindow

logger = logging.getLogger(__name__)
DRAIN_PERIOD_S = 0.25  # a drain looks again this often for requests that reached decoding

__all__ = ["DecodeWorker", "PrefillClient"]


class DecodeWorker:
    role = "decode"

    def __init__(
        self,
        config: ClusterConfig,
        prefill_client: PrefillClient | None = None,
        *,
        instance_id: str | None = None,
    ) -> None:
        self.config = config.for_pool("decode")
        self.faults = FaultPoints.from_config(self.config.testing)
        self._pool: KVPool | None = None
        runner = create_runner(self.config, kv_allocator=self._allocate_pool)
        self.engine = EngineClient(
            LLMEngine(self.config, runner=runner, role="decode"),
            name="decode-engine",
            before_step=lambda: self.faults.hit("engine.step"),
        )
        pool = self._pool or KVPool(self.engine.kv_cache, self.engine.kv_layout)
        self.instance_id = instance_id or uuid.uuid4().hex
        self.receiver = KVReceiver(self.config.transfer, pool, instance_id=self.instance_id)
        # Live migration: this replica's requests' KV, leased to the decode replica taking
        # them over when this one is drained.
        self.departures: Departures | None = None
        self.sender: KVSender | None = None
        if self.config.decode.migrate_on_drain:
            self.sender = KVSender(
                self.config.transfer,
                pool,
                on_release=self._on_release,
                instance_id=f"{self.instance_id}-out",
                epoch=time.time_ns(),
                fault_points=self.faults,
            )
            self.departures = Departures(self.sender, self.config.decode.migration_claim_s)
        self.draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self._departed: set[str] = set()  # requests a drain tried to move (once each)
        self.prefill_client = prefill_client
        self._rng = random.Random()
        # Recent time per output token of finished requests, one of the autoscaling signals.
        self.recent_tpot = RecentWindow(self.config.decode.autoscaling.look_back_period_s)
        self.counters = {
            "local_prefills": 0,
            "remote_prefills": 0,
            "recomputed_after_failure": 0,
            "transfer_failures": 0,
            "prefill_call_failures": 0,
            "pulled_blocks": 0,
            "streamed_parts": 0,
            "reused_blocks": 0,
            "migrated_out": 0,  # moved to another decode replica (their KV pulled)
            "migrations_resumed": 0,  # paused to move, no replica took them: decoded on here
            "migrated_in": 0,  # taken over from a drained decode replica
        }
        self._ctx = DecodeContext(
            self.config,
            self.engine,
            self.receiver,
            prefill_client,
            self.faults,
            self.counters,
            self.recent_tpot,
            departures=self.departures,
            replica_id=self.instance_id,
        )

    def _allocate_pool(
        self, layout: KVLayout, num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        # Another replica on this host may map it to take a migrating request (shm: one copy).
        # A tensor-parallel engine's ranks share it (every rank its heads): always shared then.
        shared = device.type == "cpu" and (
            ("shm" in self.config.transfer.transports and self.config.decode.migrate_on_drain)
            or self.config.model.tensor_parallel_size > 1
        )
        self._pool = KVPool.allocate(layout, num_blocks, shared=shared, device=device.type)
        return self._pool.tensor

    def _on_release(self, request_id: str, reason: str) -> None:
        if self.departures is not None:
            self.departures.on_release(request_id, reason)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> DecodeWorker:
        self.receiver.start()
        if self.sender is not None:
            self.sender.start()
        self.engine.start()
        return self

    def close(self) -> None:
        if self._drain_task is not None:  # (close may run on another thread than its loop)
            with contextlib.suppress(RuntimeError):  # that loop is closed: the task is gone
                self._drain_task.get_loop().call_soon_threadsafe(self._drain_task.cancel)
        if self.sender is not None:
            self.sender.close()  # releases migration leases (reason "closed")
        self.engine.stop()
        self.receiver.close()

    def is_alive(self) -> bool:
        alive = self.engine.is_alive() and self.receiver.is_alive()
        return alive and (self.sender is None or self.sender.is_alive())

    # -- drain --------------------------------------------------------------------------------

    async def drain(self) -> dict[str, int]:
        """Stop taking calls; move every decoding request to another decode replica (live
        migration, ``decode.migrate_on_drain``), and keep moving those that reach decoding
        later, until none is left. Returns the first pass: how many started to move, and how
        many stay (not decoding yet, several samples, or migration off)."""
        self.draining = True
        moving = await self._depart_all()
        if self._drain_task is None and self.departures is not None:
            self._drain_task = asyncio.create_task(self._keep_draining())
        return {"migrating": moving, "staying": len(self._ctx.live) - moving}

    async def _depart_all(self) -> int:
        moving = 0
        for handoff in list(self._ctx.live):
            if handoff.rid in self._departed or handoff.stage != "decode":
                continue
            if await handoff.depart():
                self._departed.add(handoff.rid)
                moving += 1
        return moving

    async def _keep_draining(self) -> None:
        while self._ctx.live:
            await asyncio.sleep(DRAIN_PERIOD_S)
            try:
                await self._depart_all()
            except Exception:  # an engine gone: its streams fail on their own
                logger.exception("draining: moving requests failed")
                return

    # -- the call -----------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamChunk | Migrating]:
        if self.draining:  # before any work: the caller retries on another replica
            resume = call.resume
            if resume is not None and resume.source_replica == self.instance_id and self.departures:
                self.departures.refuse(call.request_id)  # it came back: it stays here
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "this decode replica is draining", call.request_id
            )
        if call.resume is not None:
            seed = call.resume.seed
        elif call.params.seed is not None:
            seed = call.params.seed
        else:
            seed = self._rng.getrandbits(63)
        # Closed here, not left to the garbage collector, however this stream ends.
        async with contextlib.aclosing(RequestHandoff(self._ctx, call, seed).stream()) as chunks:
            async for chunk in chunks:
                yield chunk

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "role": "decode",
            "engine": self.engine.stats(),
            "transfer": self.receiver.stats(),
            "migration_transfer": self.sender.stats() if self.sender is not None else {},
            "num_active_leases": self.sender.num_active_leases if self.sender is not None else 0,
            "endpoint": self.sender.endpoint if self.sender is not None else "",
            "draining": self.draining,
            "recent_tpot_ms": self.recent_tpot.median(),
            "peak_running": self.engine.peak_running,
            "handoff_stages": dict(Counter(h.stage for h in self._ctx.live)),
            **self.counters,
        }
