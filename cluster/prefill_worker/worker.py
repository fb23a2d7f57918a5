"""Prefill server core (Ray-free): an engine in prefill role, a KV sender, and leases.

Lifecycle of one request (``prefill(call)`` is an async stream):
  1. The request joins the engine as prefill-only, with the decode side's seed, so the first
     token is the one a single-process run would draw.
  2. When its prefill completes the engine samples the first token and keeps the prompt's blocks
     held (not freed, not evictable).
  3. The blocks are leased to the KV sender, which returns the ``KVTransferParams`` handle.
  4. The stream yields ``PrefillReply(first token, handle)`` at once, then stays open: the
     caller (and Ray Serve) sees the leased work as ongoing.
  5. The lease ends when the decode side acks its pull, when it expires (no heartbeat), or when
     either side aborts; the sender's release callback frees the blocks in the engine and the
     stream ends. Cancelling the stream aborts the lease (or the prefill if still running).

A request whose first token already finishes it (EOS, a stop token) frees its blocks and
replies without a handle. Threads: the engine loop thread owns the engine, the ``kv-sender``
thread serves pulls; asyncio callers only enqueue work for either.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.common.autoscaling_stats import RecentWindow
from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.faults import FaultPoints
from cluster.common.kv_layout import KVLayout
from cluster.common.protocol import PrefillCall, PrefillReply
from cluster.config import ClusterConfig
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.model_runner import create_runner
from cluster.engine.step_loop import EngineLoop
from cluster.kv_transfer import KVPool, KVSender

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    loop: asyncio.AbstractEventLoop
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""


class PrefillServer:
    def __init__(
        self, config: ClusterConfig, *, instance_id: str | None = None, epoch: int | None = None
    ) -> None:
        self.config = config.for_pool("prefill")
        self.faults = FaultPoints(self.config.testing.fault_points)
        self._pool: KVPool | None = None
        runner = create_runner(self.config, kv_allocator=self._allocate_pool)
        self.engine = LLMEngine(self.config, runner=runner)
        self.loop = EngineLoop(
            self.engine, name="prefill-engine", before_step=lambda: self.faults.hit("engine.step")
        )
        assert self._pool is not None
        self.instance_id: str = instance_id or uuid.uuid4().hex
        self.sender: KVSender = KVSender(
            self.config.transfer,
            self._pool,
            on_release=self._on_release,
            instance_id=self.instance_id,
            epoch=epoch if epoch is not None else time.time_ns(),
            fault_points=self.faults,
        )
        self._leases: dict[str, _Lease] = {}
        self.num_prefills: int = 0
        # Recent TTFT on this replica (queue + prefill), one of the autoscaling signals.
        self.recent_ttft: RecentWindow = RecentWindow(
            self.config.prefill.autoscaling.look_back_period_s
        )

    def _allocate_pool(
        self, layout: KVLayout, num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        # Same-host decode replicas map this pool read-only (shm transport: one copy).
        shared = device.type == "cpu" and "shm" in self.config.transfer.transports
        self._pool = KVPool.allocate(layout, num_blocks, shared=shared, device=device.type)
        return self._pool.tensor

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> PrefillServer:
        self.sender.start()
        self.loop.start()
        return self

    def close(self) -> None:
        self.sender.close()  # releases remaining leases (reason "closed")
        self.loop.stop()

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint

    def is_alive(self) -> bool:
        return self.loop.is_alive() and self.sender.is_alive()

    @property
    def num_active_leases(self) -> int:
        return self.sender.num_active_leases

    # -- the call -----------------------------------------------------------------------------

    async def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        aloop = asyncio.get_running_loop()
        arrival = time.monotonic()
        # An internal id per call: a retried request never collides with a lease still held.
        rid = f"{call.request_id}#{uuid.uuid4().hex[:8]}"
        first: asyncio.Future[RequestOutput] = aloop.create_future()

        def sink(out: RequestOutput) -> None:
            aloop.call_soon_threadsafe(_resolve, first, out)

        lease: _Lease | None = None
        registered = False
        try:
            try:
                await asyncio.wrap_future(
                    self.loop.add_request(
                        rid,
                        call.prompt_token_ids,
                        call.params,
                        sink,
                        prefill_only=True,
                        seed=call.seed,
                    )
                )
            except ValueError as e:
                raise PDServeError(ErrorCode.INVALID_ARGUMENT, str(e), call.request_id) from None
            out = await first
            if out.error is not None:
                raise PDServeError(ErrorCode.UNAVAILABLE, out.error, call.request_id)
            self.num_prefills += 1
            queue_ms, prefill_ms = _phase_ms(out, arrival)
            self.recent_ttft.add(queue_ms + prefill_ms)
            # Prefill-only requests end as "length" after their first token; a real finish is a
            # stop (EOS, stop token) or a request that wanted a single token.
            real_finish = out.finish_reason != "length" or call.params.max_tokens <= 1
            reply = PrefillReply(
                request_id=call.request_id,
                first_token_id=out.new_token_ids[0],
                first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
                first_top_logprobs=out.new_top_logprobs[0] if out.new_top_logprobs else None,
                kv=None,
                finish_reason=out.finish_reason if real_finish else None,
                num_cached_tokens=out.num_cached_tokens,
                prefill_queue_ms=queue_ms,
                prefill_ms=prefill_ms,
            )
            if reply.finish_reason is not None:
                self.loop.call(lambda eng: eng.release(rid))  # nothing to pull: free at once
                yield reply
                return
            await self.faults.hit_async("p.after_prefill_before_publish")
            block_ids = await asyncio.wrap_future(
                self.loop.call(lambda eng: list(eng.held_block_ids(rid)))
            )
            lease = self._leases[rid] = _Lease(aloop)
            params = self.sender.register(
                rid,
                block_ids,
                num_tokens=len(call.prompt_token_ids),
                block_hashes=call.block_hashes[: len(block_ids)],
            )
            registered = True
            await self.faults.hit_async("p.after_publish_before_send")
            reply.kv = params.to_dict()
            yield reply
            await lease.ended.wait()
            logger.debug("request %s: lease ended (%s)", call.request_id, lease.reason)
        finally:
            if registered and lease is not None and not lease.ended.is_set():
                self.sender.abort(rid)  # the release callback frees the blocks
            elif not registered:
                self._leases.pop(rid, None)
                self.loop.abort(rid)  # still prefilling, or held but never published

    def _on_release(self, request_id: str, reason: str) -> None:
        """KV sender thread: a lease ended. Free the blocks on the engine thread, wake the call."""
        self.loop.call(lambda eng: eng.release(request_id))
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.reason = reason
            lease.loop.call_soon_threadsafe(lease.ended.set)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "engine": self.loop.stats(),
            "transfer": self.sender.stats(),
            "num_active_leases": self.sender.num_active_leases,
            "num_prefills": self.num_prefills,
            "recent_ttft_ms": self.recent_ttft.median(),
            "endpoint": self.endpoint,
            "instance_id": self.instance_id,
        }

    def check_integrity(self) -> None:
        self.loop.call(lambda eng: eng.check_integrity()).result(timeout=30)


def _resolve(fut: asyncio.Future[RequestOutput], out: RequestOutput) -> None:
    if not fut.done():
        fut.set_result(out)


def _phase_ms(out: RequestOutput, arrival: float) -> tuple[float, float]:
    """(queue, compute) milliseconds of a prefill: arrival -> scheduled -> first token."""
    scheduled = out.scheduled_time if out.scheduled_time is not None else arrival
    first = out.first_token_time if out.first_token_time is not None else time.monotonic()
    return max(0.0, (scheduled - arrival) * 1000), max(0.0, (first - scheduled) * 1000)
