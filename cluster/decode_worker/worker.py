"""Decode server core (Ray-free): an engine in decode role and a KV receiver.

The decode replica owns each request's prefill/decode hand-off (``generate(call)`` streams):
  1. It matches its own prefix cache and decides: if the uncached part of the prompt is at most
     ``decode.local_prefill_threshold`` tokens (or no prefill pool is reachable) it prefills
     locally with chunked prefill; otherwise it goes remote.
  2. Remote: the request joins the engine waiting for KV; the engine reserves its blocks (its own
     cached prefix first) while the prefill pool computes the prompt.
  3. The prefill reply brings the first token: it is streamed at once (TTFT does not wait for
     the transfer). Its lease is heartbeated while the request waits for blocks.
  4. Only the blocks not cached here are pulled, straight into the reserved blocks; the pull's
     ack frees the prefill side. The request then decodes in the continuous batch.
  5. A failed prefill call or pull: recompute locally (``transfer.on_failure: recompute``, exact
     thanks to seeded sampling) or end with an error. Cancelling the stream aborts the request
     here, the pull, and the prefill call. Deadlines end the request with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from cluster.common.autoscaling_stats import RecentWindow
from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.faults import FaultPoints
from cluster.common.hashing import hash_block_tokens
from cluster.common.kv_wire import KVTransferError, KVTransferParams
from cluster.common.protocol import GenerateCall, PrefillCall, PrefillReply, StreamChunk, Usage
from cluster.config import ClusterConfig
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.scheduler import KVReservation
from cluster.engine.step_loop import EngineLoop
from cluster.kv_transfer import KVPool, KVReceiver

logger = logging.getLogger(__name__)


class PrefillClient(Protocol):
    """How a decode replica reaches the prefill pool (Ray Serve handle, or a test harness)."""

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]: ...


class DecodeServer:
    def __init__(
        self,
        config: ClusterConfig,
        prefill_client: PrefillClient | None = None,
        *,
        instance_id: str | None = None,
    ) -> None:
        self.config = config.for_pool("decode")
        self.faults = FaultPoints(self.config.testing.fault_points)
        self.engine = LLMEngine(self.config)
        runner = self.engine.runner
        self.block_size = self.config.cache.block_size
        self.pool = KVPool(runner.kv_cache, runner.layout)
        self.loop = EngineLoop(
            self.engine,
            name="decode-engine",
            before_step=lambda: self.faults.hit("engine.step"),
            after_step=self._hand_out_reservations,
        )
        self.receiver = KVReceiver(self.config.transfer, self.pool, instance_id=instance_id)
        self.prefill_client = prefill_client
        self._reservations: dict[str, asyncio.Future[KVReservation]] = {}
        self._lock = threading.Lock()  # the reservation table: engine thread and event loop
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
            "reused_blocks": 0,
        }

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> DecodeServer:
        self.receiver.start()
        self.loop.start()
        return self

    def close(self) -> None:
        self.loop.stop()
        self.receiver.close()

    def is_alive(self) -> bool:
        return self.loop.is_alive() and self.receiver.is_alive()

    # -- the call -----------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamChunk]:
        arrival = time.monotonic()
        params = call.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        hashes = call.block_hashes or hash_block_tokens(call.prompt_token_ids, self.block_size)
        num_hit = await self._call(
            lambda eng: len(eng.block_manager.match_prefix(hashes, call.prompt_token_ids))
        )
        uncached = len(call.prompt_token_ids) - num_hit * self.block_size
        threshold = self.config.decode.local_prefill_threshold
        remote = self.prefill_client is not None and uncached > threshold
        run = _Run(self, call, seed, arrival, remote)
        async for chunk in run.stream(hashes):
            yield chunk

    async def _call(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.loop.call(fn))

    def _hand_out_reservations(self, engine: LLMEngine) -> None:
        """Engine thread, after each step: give new block reservations to their waiting calls."""
        for res in engine.take_reservations():
            with self._lock:
                fut = self._reservations.pop(res.request_id, None)
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(_resolve, fut, res)

    def _expect_reservation(self, request_id: str) -> asyncio.Future[KVReservation]:
        fut: asyncio.Future[KVReservation] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._reservations[request_id] = fut
        return fut

    def _forget_reservation(self, request_id: str) -> None:
        with self._lock:
            self._reservations.pop(request_id, None)

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "role": "decode",
            "engine": self.loop.stats(),
            "transfer": self.receiver.stats(),
            "recent_tpot_ms": self.recent_tpot.median(),
            **self.counters,
        }

    def check_integrity(self) -> None:
        self.loop.call(lambda eng: eng.check_integrity()).result(timeout=30)


class _Run:
    """One request's hand-off and stream on a decode replica."""

    def __init__(
        self, server: DecodeServer, call: GenerateCall, seed: int, arrival: float, remote: bool
    ) -> None:
        self.server = server
        self.call = call
        self.seed = seed
        self.arrival = arrival
        self.remote = remote
        self.rid = call.request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.usage = Usage(prefill_mode="remote" if remote else "local")
        self.usage.phases["router_queue_ms"] = call.router_queue_ms
        self.first_token_at: float | None = None
        self.finished = False
        self.kv: KVTransferParams | None = None
        self.kv_done = False
        self.remote_cached_tokens: int | None = None

    def _sink(self, aloop: asyncio.AbstractEventLoop) -> Any:
        return lambda out: aloop.call_soon_threadsafe(self.queue.put_nowait, out)

    async def stream(self, hashes: list[int]) -> AsyncIterator[StreamChunk]:
        srv = self.server
        aloop = asyncio.get_running_loop()
        prefill_stream: AsyncIterator[PrefillReply] | None = None
        reservation: asyncio.Future[KVReservation] | None = None
        try:
            if self.remote:
                reservation = srv._expect_reservation(self.rid)
            try:
                await asyncio.wrap_future(
                    srv.loop.add_request(
                        self.rid,
                        self.call.prompt_token_ids,
                        self.call.params,
                        self._sink(aloop),
                        seed=self.seed,
                        kv_pending=self.remote,
                        arrival_time=self.arrival,
                    )
                )
            except ValueError as e:
                code = (
                    ErrorCode.ALREADY_EXISTS
                    if "already exists" in str(e)
                    else (ErrorCode.INVALID_ARGUMENT)
                )
                raise PDServeError(code, str(e), self.rid) from None
            if self.remote:
                srv.counters["remote_prefills"] += 1
                assert reservation is not None and srv.prefill_client is not None
                prefill_stream = srv.prefill_client.prefill(
                    PrefillCall(
                        request_id=self.rid,
                        prompt_token_ids=self.call.prompt_token_ids,
                        block_hashes=hashes,
                        params=self.call.params,
                        seed=self.seed,
                        decode_endpoint=srv.receiver.instance_id,
                        deadline=self.call.deadline,
                    )
                )
                async for chunk in self._remote_handoff(prefill_stream, reservation):
                    yield chunk
            else:
                srv.counters["local_prefills"] += 1
            async for chunk in self._decode():
                yield chunk
        finally:
            if reservation is not None and not reservation.done():
                srv._forget_reservation(self.rid)
                reservation.cancel()
            if self.kv is not None and not self.kv_done:
                srv.receiver.abort(self.kv)  # tells the prefill side to free its blocks
            if prefill_stream is not None:
                await _aclose(prefill_stream)
            if not self.finished:
                srv.loop.abort(self.rid)

    async def _remote_handoff(
        self,
        prefill_stream: AsyncIterator[PrefillReply],
        reservation: asyncio.Future[KVReservation],
    ) -> AsyncIterator[StreamChunk]:
        srv = self.server
        try:
            reply = await self._with_deadline(prefill_stream.__anext__())
        except PDServeError as e:
            if e.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.DEADLINE_EXCEEDED):
                raise
            await self._fail_or_recompute(f"prefill call failed: {e.message}")
            return
        except (StopAsyncIteration, Exception) as e:  # a dead or unreachable prefill replica
            srv.counters["prefill_call_failures"] += 1
            await self._fail_or_recompute(f"prefill call failed: {type(e).__name__}: {e}")
            return
        self.usage.phases["prefill_queue_ms"] = reply.prefill_queue_ms
        self.usage.phases["prefill_ms"] = reply.prefill_ms
        self.remote_cached_tokens = reply.num_cached_tokens
        if reply.kv is not None:
            self.kv = KVTransferParams.from_dict(reply.kv)
        first = await srv._call(
            lambda eng: eng.accept_first_token(
                self.rid, reply.first_token_id, reply.first_logprob, reply.first_top_logprobs
            )
        )
        chunk = self._chunk(first)
        yield chunk  # the first token, before any KV moves
        if first.finished or self.kv is None:
            return
        kv = self.kv
        srv.receiver.hold(kv)  # heartbeat the lease while the request waits for blocks
        res = await self._with_deadline(reservation)
        self.usage.phases["decode_queue_ms"] = (time.monotonic() - self.arrival) * 1000
        await srv.faults.hit_async("d.after_alloc_before_pull")
        k = min(res.num_hit_blocks, len(kv.block_ids))
        t0 = time.monotonic()
        try:
            if k < len(kv.block_ids):
                result = await self._with_deadline(
                    asyncio.wrap_future(
                        srv.receiver.pull_async(kv, res.block_ids[k:], first_block=k)
                    )
                )
                srv.counters["pulled_blocks"] += result.num_blocks
            else:
                srv.receiver.abort(kv, reason="not_needed")  # all cached here: release it
            srv.counters["reused_blocks"] += k
            self.kv_done = True
        except KVTransferError as e:
            self.kv_done = True  # the receiver already told the sender (or the sender is gone)
            srv.counters["transfer_failures"] += 1
            await self._fail_or_recompute(f"KV transfer failed: {e.reason}: {e}")
            return
        self.usage.phases["transfer_ms"] = (time.monotonic() - t0) * 1000
        await srv._call(lambda eng: eng.kv_arrived(self.rid))

    async def _fail_or_recompute(self, why: str) -> None:
        srv = self.server
        recompute = srv.config.transfer.on_failure == "recompute"
        logger.warning(
            "request %s: %s; %s", self.rid, why, "prefilling locally" if recompute else "failing it"
        )
        if recompute:
            srv.counters["recomputed_after_failure"] += 1
            self.usage.prefill_mode = "local"
        await srv._call(lambda eng: eng.kv_failed(self.rid, recompute=recompute, error=why))

    async def _decode(self) -> AsyncIterator[StreamChunk]:
        srv = self.server
        while True:
            out = await self._with_deadline(self.queue.get())
            if out.error is not None:
                self.finished = True
                code = ErrorCode.ABORTED if self.first_token_at else ErrorCode.UNAVAILABLE
                raise PDServeError(code, out.error, self.rid)
            for _ in out.new_token_ids:
                await srv.faults.hit_async("d.mid_decode_token_k")
            chunk = self._chunk(out)
            if out.finished:
                self.finished = True
                chunk.usage = self._final_usage(out)
                self._record_tpot(out)
            yield chunk
            if out.finished:
                return

    def _record_tpot(self, out: RequestOutput) -> None:
        if self.first_token_at is not None and out.num_output_tokens > 1:
            decode_s = time.monotonic() - self.first_token_at
            self.server.recent_tpot.add(decode_s * 1000 / (out.num_output_tokens - 1))

    def _chunk(self, out: RequestOutput) -> StreamChunk:
        if self.first_token_at is None and out.new_token_ids:
            self.first_token_at = time.monotonic()
            if not self.remote or self.usage.prefill_mode == "local":
                sched = out.scheduled_time or self.arrival
                self.usage.phases["decode_queue_ms"] = (sched - self.arrival) * 1000
                self.usage.phases["prefill_ms"] = (self.first_token_at - sched) * 1000
        if out.finished:
            self.finished = True
        return StreamChunk(
            request_id=self.rid,
            token_ids=list(out.new_token_ids),
            text=out.new_text,
            logprobs=out.new_logprobs,
            top_logprobs=out.new_top_logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            usage=self._final_usage(out) if out.finished else None,
        )

    def _final_usage(self, out: RequestOutput) -> Usage:
        u = self.usage
        u.prompt_tokens = out.num_prompt_tokens
        u.completion_tokens = out.num_output_tokens
        # A remote prefill's compute was saved by the prefill replica's cache; a local one's (or
        # a recompute's) by this replica's.
        remote = self.remote_cached_tokens if u.prefill_mode == "remote" else None
        u.cached_tokens = out.num_cached_tokens if remote is None else remote
        if self.first_token_at is not None:
            u.phases["decode_ms"] = (time.monotonic() - self.first_token_at) * 1000
        return u

    async def _with_deadline(self, aw: Any) -> Any:
        remaining = self.call.remaining_s()
        if remaining is None:
            return await aw
        try:
            return await asyncio.wait_for(aw, timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            raise PDServeError(
                ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed", self.rid
            ) from None


def _resolve(fut: asyncio.Future[KVReservation], res: KVReservation) -> None:
    if not fut.done():
        fut.set_result(res)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # a dead prefill replica's stream may fail to close: it is gone anyway
            logger.debug("closing a prefill stream failed", exc_info=True)
