"""The prefill pool's core (Ray-free): an engine in the prefill role, a KV sender, and leases.

Lifecycle of one request (``prefill(call)`` is an async stream):
  1. The request joins the engine with the decode side's seed, so the first token is the one a
     single-process run would draw.
  2. When its prefill completes the engine samples the first token; the prefill hand-off ends
     the request there and holds its blocks (not freed, not evictable). That output carries
     the held block table.
  3. The blocks are leased to the KV sender, which returns the ``KVTransferParams`` handle.
  4. The stream yields ``PrefillReply(first tokens, handle)`` at once, then stays open: the
     caller (and Ray Serve) sees the leased work as ongoing. A first token carries its text as
     the decode engine would stream it (held back for a stop string), so the decode replica
     sends it to the client straight from the reply.
  5. The lease ends when the decode side acks its pull, when it expires (no heartbeat), or when
     either side aborts; the sender's release callback frees the blocks in the engine and the
     stream ends. Cancelling the stream aborts the lease (or the prefill if still running).

A streamed prompt (``transfer.stream_min_tokens``; chunked prefill) is leased before step 2: after
each chunk the engine announces the full blocks computed so far; the lease grows to them and the
stream yields ``PrefillProgress(handle so far)``, so the decode side pulls them while the next
chunks compute. Step 3 then only seals the lease with the tail (the last chunk's blocks).

A request whose first token already finishes it (EOS, a stop token, ``max_tokens`` 1) frees its
blocks and replies with its finish reason and no handle (a streamed prompt's lease is aborted).
Threads: the engine loop thread owns the engine, the ``kv-sender`` thread serves pulls; asyncio
callers only enqueue work for either.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.faults import FaultPoints
from cluster.common.kv_layout import KVLayout
from cluster.common.protocol import FirstToken, PrefillCall, PrefillProgress, PrefillReply
from cluster.config import ClusterConfig
from cluster.engine.client import EngineClient
from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput
from cluster.engine.runner_registry import create_runner
from cluster.engine.step_loop import EngineDeadError
from cluster.kv_transfer import KVPool, KVSender, KVTransferParams
from cluster.serving.signals import RecentWindow

logger = logging.getLogger(__name__)


class _CallState:
    """One prefill call on this replica: its engine request, outputs and lease."""

    def __init__(self, call: PrefillCall, aloop: asyncio.AbstractEventLoop) -> None:
        self.call = call
        self.aloop = aloop
        # An internal id per call: a retried request never collides with a lease still held.
        self.rid = f"{call.request_id}#{uuid.uuid4().hex[:8]}"
        self.arrival = time.monotonic()
        self.outputs: asyncio.Queue[RequestOutput | None] = asyncio.Queue()  # None: lease over
        self.ended = asyncio.Event()  # set by the sender thread when the lease ends
        # No lease out yet: an abort frees the request wherever it is. Once leased, the lease's
        # release frees its blocks (and ends the request if it still prefills).
        self.in_engine = True
        self.leased = False
        self.samples: list[RequestOutput] = []  # samples' first tokens (a full last block)
        self.last: RequestOutput | None = None  # the output that ended the prefill here

    def sink(self, out: RequestOutput) -> None:
        """Engine thread -> this call's queue (never blocks)."""
        self.aloop.call_soon_threadsafe(self.outputs.put_nowait, out)

    def lease_ended(self) -> None:
        """Sender thread: the lease ended; the call's stream ends (its prompt may still run)."""
        self.aloop.call_soon_threadsafe(self.ended.set)
        self.aloop.call_soon_threadsafe(self.outputs.put_nowait, None)


class PrefillWorker:
    role = "prefill"

    def __init__(
        self,
        config: ClusterConfig,
        *,
        instance_id: str | None = None,
        epoch: int | None = None,
        kv_port: int = 0,
    ) -> None:
        self.config = config.for_pool("prefill")
        self.faults = FaultPoints.from_config(self.config.testing)
        self._pool: KVPool | None = None
        runner = create_runner(self.config, kv_allocator=self._allocate_pool)
        self.engine = EngineClient(
            LLMEngine(self.config, runner=runner, role="prefill"),
            name="prefill-engine",
            before_step=lambda: self.faults.hit("engine.step"),
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
            port=kv_port,
        )
        # Per call: the event set when its lease ends (the call's stream then ends) and its
        # output queue (told None then, in case the prompt was still prefilling).
        self._leases: dict[str, _CallState] = {}
        self.num_prefills: int = 0
        # Recent TTFT on this replica (queue + prefill), one of the autoscaling signals.
        self.recent_ttft: RecentWindow = RecentWindow(
            self.config.prefill.autoscaling.look_back_period_s
        )

    def _allocate_pool(
        self, layout: KVLayout, num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        # Same-host decode replicas map this pool read-only (shm transport: one copy).
        # A tensor-parallel engine's ranks share it too (every rank its heads).
        shared = device.type == "cpu" and (
            "shm" in self.config.transfer.transports or self.config.model.tensor_parallel_size > 1
        )
        self._pool = KVPool.allocate(layout, num_blocks, shared=shared, device=device.type)
        return self._pool.tensor

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> PrefillWorker:
        self.sender.start()
        self.engine.start()
        return self

    def close(self) -> None:
        self.sender.close()  # releases remaining leases (reason "closed")
        self.engine.stop()

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint

    def is_alive(self) -> bool:
        return self.engine.is_alive() and self.sender.is_alive()

    # -- the call -----------------------------------------------------------------------------

    def _check_layout(self, call: PrefillCall) -> None:
        """Refuse at once, before any work, a caller whose KV cache has another layout (dtype,
        quantization, shape): its pool could not take our blocks."""
        assert self._pool is not None
        mismatch = self._pool.layout.mismatch(call.kv_layout)
        if mismatch is not None:
            raise PDServeError(
                ErrorCode.INTERNAL,
                f"KV layout mismatch between the pools, the prefill pool refuses the hand-off: "
                f"{mismatch}",
                call.request_id,
            )

    async def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillProgress | PrefillReply]:
        self._check_layout(call)
        state = _CallState(call, asyncio.get_running_loop())
        self._leases[state.rid] = state
        try:
            await self._add(state)
            while (progress := await self._next_progress(state)) is not None:
                yield progress
            reply = await self._reply(state)
            yield reply
            if reply.kv is not None:
                await state.ended.wait()
        finally:
            if state.in_engine:
                self.engine.abort(state.rid)
            elif state.leased and not state.ended.is_set():
                self.sender.abort(state.rid)  # the release callback frees the blocks
            self._leases.pop(state.rid, None)

    async def _add(self, state: _CallState) -> None:
        call = state.call
        request = EngineRequest(
            state.rid, call.prompt_token_ids, call.params, seed=call.seed, n=call.n
        )
        try:
            await self.engine.add(request, state.sink)
        except ValueError as e:
            state.in_engine = False
            raise PDServeError(ErrorCode.INVALID_ARGUMENT, str(e), call.request_id) from None
        except EngineDeadError:  # its step failed: Serve replaces this replica
            state.in_engine = False
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "the prefill replica is unavailable", call.request_id
            ) from None

    async def _next_progress(self, state: _CallState) -> PrefillProgress | None:
        """A streamed prompt's blocks so far, leased; None once the prefill ended here (its
        first token, or the lease's end: ``state.last``)."""
        while True:
            out = await state.outputs.get()
            if out is not None and out.index > 0:
                if out.new_token_ids:  # a sample's, in the same step, just before the leader's
                    state.samples.append(out)
                continue
            if out is None or out.streamed_block_ids is None:
                state.last = out
                return None
            progress = self._stream(state, out.streamed_block_ids)
            state.in_engine, state.leased = False, True
            return progress

    async def _reply(self, state: _CallState) -> PrefillReply:
        """The first tokens and, unless the first token ended the request, the lease of the
        blocks held for the pull."""
        call, out = state.call, state.last
        if out is not None and out.error is not None:  # its text stays in this log
            logger.error("request %s: %s", call.request_id, out.error)
            raise PDServeError(ErrorCode.UNAVAILABLE, "the prefill replica failed", call.request_id)
        if out is None or (out.finished and not out.new_token_ids):
            raise self._lease_gone(call)
        self.num_prefills += 1
        kv: KVTransferParams | None = None
        if out.held_block_ids is None:  # the first token finished it: nothing to pull
            state.in_engine = False  # a streamed prompt's pins go with its lease, aborted below
        else:
            await self.faults.hit_async("p.after_prefill_before_publish")
            kv = self._publish(state, out.held_block_ids)
            state.in_engine, state.leased = False, True
            await self.faults.hit_async("p.after_publish_before_send")
        samples = sorted(state.samples, key=_index)
        queue_ms, prefill_ms = self._timings(out, state.arrival)
        return PrefillReply(
            request_id=call.request_id,
            first_tokens=tuple(first_token(o) for o in (out, *samples)),
            kv=kv,
            num_cached_tokens=out.num_cached_tokens,
            prefill_queue_ms=queue_ms,
            prefill_ms=prefill_ms,
        )

    def _stream(self, state: _CallState, block_ids: list[int]) -> PrefillProgress:
        """A streamed prompt's blocks so far: lease them (or grow the lease) and announce."""
        call = state.call
        num_tokens = len(block_ids) * self.engine.block_size
        hashes = call.block_hashes[: len(block_ids)]
        if not state.leased:
            params = self.sender.register(
                state.rid, block_ids, num_tokens=num_tokens, block_hashes=hashes, streamed=True
            )
        else:
            extended = self.sender.extend(
                state.rid, block_ids, num_tokens=num_tokens, block_hashes=hashes
            )
            if extended is None:
                raise self._lease_gone(call)
            params = extended
        return PrefillProgress(call.request_id, params)

    def _publish(self, state: _CallState, held: list[int]) -> KVTransferParams:
        """The first token's held table: lease it, or seal a streamed prompt's lease with it."""
        call = state.call
        hashes = call.block_hashes[: len(held)]
        num_tokens = len(call.prompt_token_ids)
        if not state.leased:
            return self.sender.register(state.rid, held, num_tokens=num_tokens, block_hashes=hashes)
        params = self.sender.extend(
            state.rid, held, num_tokens=num_tokens, block_hashes=hashes, last=True
        )
        if params is None:  # the release callback frees the held table too
            raise self._lease_gone(call)
        return params

    @staticmethod
    def _lease_gone(call: PrefillCall) -> PDServeError:
        return PDServeError(
            ErrorCode.UNAVAILABLE,
            "the KV lease ended while the prompt was prefilling",
            call.request_id,
        )

    def _timings(self, out: RequestOutput, arrival: float) -> tuple[float, float]:
        """(queue, compute) milliseconds: arrival -> scheduled -> first token."""
        scheduled = out.scheduled_time if out.scheduled_time is not None else arrival
        first = out.first_token_time if out.first_token_time is not None else time.monotonic()
        queue_ms = max(0.0, (scheduled - arrival) * 1000)
        prefill_ms = max(0.0, (first - scheduled) * 1000)
        self.recent_ttft.add(queue_ms + prefill_ms)
        return queue_ms, prefill_ms

    def _on_release(self, request_id: str, reason: str) -> None:
        """KV sender thread: a lease ended. Free the blocks on the engine thread, wake the call."""
        self.engine.release(request_id)
        state = self._leases.get(request_id)
        if state is not None:
            logger.debug("request %s: lease ended (%s)", request_id, reason)
            state.lease_ended()

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "engine": self.engine.stats(),
            "transfer": self.sender.stats(),
            "num_active_leases": self.sender.num_active_leases,
            "num_prefills": self.num_prefills,
            "recent_ttft_ms": self.recent_ttft.median(),
            "endpoint": self.endpoint,
            "instance_id": self.instance_id,
        }


def first_token(out: RequestOutput) -> FirstToken:
    """An output's first token as the decode replica streams it: its text (held back, or to
    the end), logprob and top logprobs when asked for, and whether it ended its sample."""
    logprob = out.new_logprobs[0] if out.new_logprobs else None
    top = out.new_top_logprobs[0] if out.new_top_logprobs else None
    return FirstToken(
        token_id=out.new_token_ids[0],
        text=out.new_text,
        logprob=logprob,
        top_logprobs=tuple(top) if top is not None else None,
        finish_reason=out.finish_reason,
    )


def _index(out: RequestOutput) -> int:
    return out.index
