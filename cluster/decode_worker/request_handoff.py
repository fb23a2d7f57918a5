"""``RequestHandoff``: one request's prefill/decode hand-off and token stream on a decode replica.

``stream()`` is the whole life of the request here (see ``worker`` for the numbered lifecycle):
add it to the engine (which says local or remote), run the remote hand-off if needed (block
reservation, prefill call, first tokens, pull, ``kv_arrived``), then relay the engine's outputs
as ``StreamChunk``s until it finishes. A remote request enters the engine thread twice: ``add``,
then ``kv_arrived`` with the prefill reply's first tokens (``kv_failed`` instead when the call or
the pull fails). The first tokens have one source, the reply: their chunks go to the client as
soon as it arrives, before any KV moves and before the engine takes them in. Whatever way the
stream ends, ``finally`` leaves nothing behind: the reservation, the pull (and with it the
prefill side's lease), the prefill call and the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.faults import FaultPoints
from cluster.common.protocol import (
    PHASES,
    FirstToken,
    GenerateCall,
    Migrating,
    PrefillCall,
    PrefillProgress,
    PrefillReply,
    ResumeState,
    StreamChunk,
    Usage,
)
from cluster.config import ClusterConfig
from cluster.decode_worker.kv_pull import KVPull
from cluster.decode_worker.migration import Departure, Departures
from cluster.engine.client import Added, EngineClient
from cluster.engine.engine import EngineRequest, RequestOutput
from cluster.engine.request import PrefillMode, Resume
from cluster.engine.step_loop import EngineDeadError
from cluster.kv_transfer import KVReceiver, KVTransferError
from cluster.serving.calls import within_deadline
from cluster.serving.signals import RecentWindow

logger = logging.getLogger(__name__)
# How long a finished request waits for its prefill call to end by itself (the prefill replica
# reads the ack in about a millisecond; it is usually done before the decode is).
CALL_END_WAIT_S = 0.5

PrefillStream = AsyncIterator[PrefillProgress | PrefillReply]


class PrefillClient(Protocol):
    """How a decode replica reaches the prefill pool (Ray Serve handle, or a test harness)."""

    def prefill(self, call: PrefillCall) -> PrefillStream: ...


@dataclass
class DecodeContext:
    """What every request's hand-off on one decode replica shares."""

    config: ClusterConfig
    engine: EngineClient
    receiver: KVReceiver
    prefill_client: PrefillClient | None
    faults: FaultPoints
    counters: dict[str, int]
    recent_tpot: RecentWindow
    # Every stream in progress here (each one's ``stage``): where requests wait, for operators
    # and for tests that look for a stream left behind.
    live: set[RequestHandoff] = dataclasses.field(default_factory=set)
    departures: Departures | None = None  # live migration away from here (None: never)
    replica_id: str = ""


class RequestHandoff:
    def __init__(self, ctx: DecodeContext, call: GenerateCall, seed: int) -> None:
        self.ctx = ctx
        self.call = call
        self.seed = seed
        self.rid = call.request_id
        self.arrival = time.monotonic()
        self.outputs: asyncio.Queue[RequestOutput | Departure] = asyncio.Queue()
        self.local_cached_tokens = 0  # this engine's prefix-cache hit, from its outputs
        self.prefill_mode = "local"  # "remote" once the engine says so; "local" on a recompute
        self.phases = dict.fromkeys(PHASES, 0.0)  # milliseconds, for the final chunk's usage
        self.phases["router_queue_ms"] = call.router_queue_ms
        self.first_token_at: float | None = None
        self.finished = False  # every sample ended (or the request failed)
        self.ended: dict[int, RequestOutput] = {}  # each finished sample's last output
        self.added: Added | None = None  # in the engine (its reservation, if remote)
        # The client has first tokens from the prefill reply that the engine has not taken in
        # yet (``kv_arrived`` / ``kv_failed`` still to come): the engine still holds the request
        # even when those tokens ended every sample.
        self.first_tokens_pending = False
        self.prefill_stream: PrefillStream | None = None
        self.pull: KVPull | None = None  # the prompt's KV, pulled into its reservation
        self.remote_cached_tokens: int | None = None
        self.failure: str | None = None  # why the hand-off failed the request, in client words
        self.prompt_logprobs: list[Any] | None = None  # sample 0's, sent with each one's first
        self.started: set[int] = set()  # samples whose first chunk went out
        # adding, blocks, prefill, first_token, pull, migrate_in, decode, migrating, ending
        self.stage = "adding"
        self.departure: Departure | None = None  # leaving for another replica (migration)
        self.decode_ms_before = 0.0  # decoding time on the replicas it came from
        self.resumed_tokens = 0  # outputs it came with (migration)
        if call.resume is not None:  # taken over from another replica: continue its figures
            self.prefill_mode = call.resume.prefill_mode
            self.phases.update(call.resume.phases)
            self.decode_ms_before = call.resume.phases.get("decode_ms", 0.0)
            self.resumed_tokens = len(call.resume.output_token_ids)
            self.started.add(0)

    async def stream(self) -> AsyncGenerator[StreamChunk | Migrating, None]:
        self.ctx.live.add(self)
        try:
            self.added = await self._add()
            if self.call.resume is not None:
                await self._take_over(self.call.resume)
                self.first_token_at = time.monotonic()
            elif self.added.remote:
                async with contextlib.aclosing(self._remote(self.added)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            else:
                self.ctx.counters["local_prefills"] += 1
            if not self.finished:  # a remote first token may already have ended it
                self.stage = "decode"
                async with contextlib.aclosing(self._decode()) as items:
                    async for item in items:
                        yield item
        except EngineDeadError:  # a step failed (entry 2): the router retries or aborts
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "the decode replica is unavailable", self.rid
            ) from None
        finally:
            # In a task of its own: a cancellation that lands on one of its awaits (a client
            # gone while the stream was already closing) must not skip the engine's abort.
            self.stage = "ending"
            await asyncio.shield(asyncio.ensure_future(self._end()))

    async def _end(self) -> None:
        """Leave nothing behind: the reservation, the pull (and with it the prefill side's
        lease), a migration's lease, the request in the engine, the prefill call."""
        try:
            ctx = self.ctx
            if self.departure is not None and ctx.departures is not None:
                if await ctx.departures.abandon(ctx.engine, self.rid, self.departure, ctx.counters):
                    self.finished = True  # moved: nothing of it left here to abort
                self.departure = None
            if self.added is not None and self.added.reservation is not None:
                self.added.reservation.cancel()
            if self.pull is not None:  # tells the prefill side to free its blocks, and waits
                await self.pull.cancel()  # until no pull writes the reserved ones any more
            # Before the prefill call closes: however that ends, the engine's blocks go.
            if self.added is not None and (not self.finished or self.first_tokens_pending):
                self.ctx.engine.abort(self.rid)
            if self.prefill_stream is not None:
                if self.pull is not None and self.pull.finished:
                    await _let_end(self.prefill_stream)
                else:
                    await _aclose(self.prefill_stream)
        finally:
            self.ctx.live.discard(self)

    async def _add(self) -> Added:
        ctx = self.ctx
        resume = self.call.resume
        prefill: PrefillMode = "auto" if ctx.prefill_client is not None else "local"
        request = EngineRequest(
            self.rid,
            self.call.prompt_token_ids,
            self.call.params,
            prefill="remote" if resume is not None else prefill,
            seed=self.seed,
            arrival_time=self.arrival,
            n=self.call.n,
            resume=None
            if resume is None
            else Resume(
                resume.output_token_ids,
                resume.num_draft_tokens,
                resume.num_accepted_tokens,
                resume.spec_track,
            ),
        )
        try:
            return await ctx.engine.add(request, self._sink(asyncio.get_running_loop()))
        except ValueError as e:
            code = ErrorCode.ALREADY_EXISTS if "already exists" in str(e) else None
            raise PDServeError(code or ErrorCode.INVALID_ARGUMENT, str(e), self.rid) from None
        except EngineDeadError:  # its step failed: Serve replaces this replica; retry elsewhere
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "the decode replica is unavailable", self.rid
            ) from None

    def _sink(self, aloop: asyncio.AbstractEventLoop) -> Callable[[RequestOutput], None]:
        """Engine thread -> this request's queue on its event loop (never blocks)."""

        def sink(out: RequestOutput) -> None:
            aloop.call_soon_threadsafe(self.outputs.put_nowait, out)

        return sink

    # -- the remote hand-off ------------------------------------------------------------------

    async def _remote(self, added: Added) -> AsyncGenerator[StreamChunk, None]:
        """Blocks here, the prefill call, its first tokens to the client, the pull, then the
        engine's second entry: ``kv_arrived`` (``kv_failed`` when the call or the pull fails)."""
        ctx = self.ctx
        self.prefill_mode = "remote"
        ctx.counters["remote_prefills"] += 1
        assert ctx.prefill_client is not None and added.reservation is not None
        pull = self.pull = KVPull(ctx.receiver, added.reservation)
        self.stage = "blocks"
        # Blocks here first, then the prefill: a prefill replica's pool then only ever holds
        # KV that has somewhere to go. (Prefilling while waiting for blocks here deadlocks two
        # full pools: these blocks reserved for prompts that cannot prefill, that pool full of
        # prompts waiting for blocks here.)
        await self.before_deadline(asyncio.shield(added.reservation))
        self.stage = "prefill"
        self.prefill_stream = ctx.prefill_client.prefill(self._prefill_call())
        reply = await self._reply(self.prefill_stream, pull)
        if reply is None:  # failed: prefilling here now, or failed with a reason
            return
        self.phases["prefill_queue_ms"] = reply.prefill_queue_ms
        self.phases["prefill_ms"] = reply.prefill_ms
        self.remote_cached_tokens = reply.num_cached_tokens
        if reply.kv is None:
            await pull.cancel()  # nothing (more) to pull: stop streamed parts before any free
        self.first_tokens_pending = True
        self.stage = "first_token"
        # The first tokens now, not once this engine's step is over nor after the KV moved.
        for index, token in enumerate(reply.first_tokens):
            yield self._chunk(self._first_output(index, token))
        if reply.kv is not None and not await self._pull(reply):
            return
        await ctx.engine.kv_arrived(self.rid, reply.first_tokens)
        self.first_tokens_pending = False

    def _prefill_call(self) -> PrefillCall:
        return PrefillCall(
            request_id=self.rid,
            prompt_token_ids=self.call.prompt_token_ids,
            block_hashes=self.call.block_hashes,
            params=self.call.params,
            seed=self.seed,
            kv_layout=self.ctx.receiver.pool.layout,
            decode_endpoint=self.ctx.receiver.instance_id,
            deadline=self.call.deadline,
            n=self.call.n,
        )

    async def _reply(self, prefill_stream: PrefillStream, pull: KVPull) -> PrefillReply | None:
        """The prefill call's reply (a streamed prompt's announced blocks start moving first);
        None when the call failed and the request was handed to ``_fail_or_recompute``."""
        try:
            while True:
                item = await self.before_deadline(prefill_stream.__anext__())
                if not isinstance(item, PrefillProgress):
                    return item
                pull.offer(item.kv)
        except PDServeError as e:
            await pull.cancel()  # a streamed part may be landing in the reserved blocks
            if e.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.DEADLINE_EXCEEDED):
                raise
            # a PDServeError's message is written for clients (a KV layout mismatch names both)
            await self._fail_or_recompute(e.message, f"{e.code.value}: {e.message}")
        except (StopAsyncIteration, Exception) as e:  # a dead or unreachable prefill replica
            await pull.cancel()
            self.ctx.counters["prefill_call_failures"] += 1
            await self._fail_or_recompute("prefill call failed", f"{type(e).__name__}: {e}")
        return None

    def _first_output(self, index: int, token: FirstToken) -> RequestOutput:
        """Sample ``index``'s first token as this engine's output for it would read: the prefill
        replica's engine computed all of it (text held back for a stop string, or the end)."""
        with_logprobs = token.logprob is not None and self.call.params.logprobs is not None
        return RequestOutput(
            self.rid,
            [token.token_id],
            token.text,
            finished=token.finish_reason is not None,
            finish_reason=token.finish_reason,
            new_logprobs=[token.logprob or 0.0] if with_logprobs else None,
            new_top_logprobs=[list(token.top_logprobs or ())] if with_logprobs else None,
            num_prompt_tokens=len(self.call.prompt_token_ids),
            num_output_tokens=1,
            index=index,
        )

    async def _pull(self, reply: PrefillReply) -> bool:
        """The prompt's KV into the reserved blocks; False when it failed (the request was
        handed to ``_fail_or_recompute`` with its first tokens)."""
        ctx, pull, kv = self.ctx, self.pull, reply.kv
        assert pull is not None and kv is not None
        pull.hold(kv)  # heartbeat the lease while the request waits for blocks
        self.stage = "pull"
        await self.before_deadline(asyncio.shield(pull.reservation))
        self.phases["decode_queue_ms"] = (time.monotonic() - self.arrival) * 1000
        await ctx.faults.hit_async("d.after_alloc_before_pull")
        t0 = time.monotonic()
        try:
            reused = await self.before_deadline(pull.finish(kv))
        except KVTransferError as e:
            await pull.cancel()
            ctx.counters["transfer_failures"] += 1
            await self._fail_or_recompute(
                f"KV transfer failed ({e.reason})", str(e), reply.first_tokens
            )
            return False
        ctx.counters["pulled_blocks"] += pull.num_pulled
        ctx.counters["streamed_parts"] += pull.num_parts
        ctx.counters["reused_blocks"] += reused
        self.phases["transfer_ms"] = (time.monotonic() - t0) * 1000
        return True

    async def _fail_or_recompute(
        self, what: str, detail: str, first_tokens: Sequence[FirstToken] = ()
    ) -> None:
        """``what`` is all a client may see (no exception text, address or path: S8); the
        ``detail`` stays in this replica's log. ``first_tokens``: those the client has."""
        ctx = self.ctx
        recompute = ctx.config.transfer.on_failure == "recompute"
        logger.warning(
            "request %s: %s: %s; %s",
            self.rid,
            what,
            detail,
            "prefilling locally" if recompute else "failing it",
        )
        if recompute:
            ctx.counters["recomputed_after_failure"] += 1
            self.prefill_mode = "local"
        else:
            self.failure = what
        await ctx.engine.kv_failed(
            self.rid, recompute=recompute, error=what, first_tokens=first_tokens
        )
        self.first_tokens_pending = False

    # -- the engine's outputs -----------------------------------------------------------------

    async def _decode(self) -> AsyncGenerator[StreamChunk | Migrating, None]:
        while True:
            outs, departure = await self._next_outputs()
            if departure is not None:
                if outs:
                    for chunk in await self._chunks(outs):
                        yield chunk
                yield Migrating(self.rid, self._resume_state(departure))
                if await self._depart(departure):
                    return
                continue
            error = outs.pop() if outs[-1].error is not None else None
            if outs:
                for chunk in await self._chunks(outs):
                    yield chunk
                if self.finished:
                    return
            if error is not None:
                raise self._failed(error)

    async def _chunks(self, outs: list[RequestOutput]) -> list[StreamChunk]:
        """A batch of outputs as one chunk per sample (sample 0's prompt logprobs go with every
        sample's first chunk)."""
        for out in outs:
            self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
            for _ in out.new_token_ids:
                await self.ctx.faults.hit_async("d.mid_decode_token_k")
        chunks = [self._chunk(out) for out in outs]
        for out in outs:
            if out.finished:
                self._record_tpot(out)
        return merge_by_sample(chunks)

    def _failed(self, error: RequestOutput) -> PDServeError:
        self.finished = True
        code = ErrorCode.ABORTED if self.first_token_at else ErrorCode.UNAVAILABLE
        if self.failure is None:  # the engine itself failed: its text stays here
            logger.error("request %s: %s", self.rid, error.error)
        return PDServeError(code, self.failure or "the decode replica failed", self.rid)

    async def _next_outputs(self) -> tuple[list[RequestOutput], Departure | None]:
        """The next output, and every one already queued behind it (to its last, an error, or
        a departure: the request is migrating): when this replica falls behind its engine, one
        chunk carries several steps' tokens, so the per-item cost of the streams (here, Ray,
        the router) does not grow with the load."""
        outs: list[RequestOutput] = []
        while True:
            item = await self.before_deadline(self.outputs.get()) if not outs else None
            if item is None:
                if self.outputs.empty():
                    return outs, None
                item = self.outputs.get_nowait()
            if isinstance(item, Departure):
                return outs, item
            outs.append(item)
            if item.finished:
                return outs, None

    async def depart(self) -> bool:
        """Drain: move this request to another decode replica (``migration``); False when it
        cannot move now (not decoding, several samples, already leaving, ending)."""
        departures = self.ctx.departures
        if (
            departures is None
            or self.stage != "decode"
            or self.finished
            or self.call.n != 1
            or self.departure is not None
        ):
            return False
        departure = await departures.start(
            self.ctx.engine, self.rid, lambda: self.stage == "ending"
        )
        if departure is None:
            return False
        self.departure = departure
        self.outputs.put_nowait(departure)  # after every output already queued
        return True

    async def _depart(self, departure: Departure) -> bool:
        """The router was told (``Migrating``): True once the target pulled the KV (the request
        is freed here, this stream ends); False: no replica took it, it decodes on here."""
        assert self.ctx.departures is not None
        self.stage = "migrating"
        await self.before_deadline(asyncio.shield(departure.ended))
        ctx = self.ctx
        moved = await self.ctx.departures.finish(ctx.engine, self.rid, departure, ctx.counters)
        self.departure = None
        if moved:
            self.finished = True
        else:
            self.stage = "decode"
        return moved

    def _resume_state(self, departure: Departure) -> ResumeState:
        """What the replica taking this request over needs (``Migrating``)."""
        ex = departure.export
        phases = dict(self.phases)
        if self.first_token_at is not None:
            decode_s = time.monotonic() - self.first_token_at
            phases["decode_ms"] = self.decode_ms_before + decode_s * 1000
        previous = self.call.resume.num_migrations if self.call.resume is not None else 0
        return ResumeState(
            source_replica=self.ctx.replica_id,
            output_token_ids=ex.output_token_ids,
            seed=ex.seed,
            kv=departure.kv,
            num_draft_tokens=ex.num_draft_tokens,
            num_accepted_tokens=ex.num_accepted_tokens,
            spec_track=ex.spec_track,
            prefill_mode=self.prefill_mode,
            cached_tokens=self.cached_tokens_so_far(),
            phases=phases,
            num_migrations=previous + 1,
        )

    async def _take_over(self, resume: ResumeState) -> None:
        """Migration, target side: the request's KV from the replica it leaves into the blocks
        reserved here (the engine has it, with the tokens the client has: ``_add``); no room
        within ``decode.migration_claim_s``, or a failed pull, fails the call (UNAVAILABLE),
        and ``_end`` aborts the lease so the source decodes on."""
        ctx, added = self.ctx, self.added
        assert added is not None and added.reservation is not None
        pull = self.pull = KVPull(ctx.receiver, added.reservation)
        pull.hold(resume.kv)  # heartbeats claim the lease at once
        self.stage = "migrate_in"
        try:
            async with asyncio.timeout(ctx.config.decode.migration_claim_s):
                await self.before_deadline(asyncio.shield(added.reservation))
        except TimeoutError:
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "no room here for the migrating request", self.rid
            ) from None
        await ctx.faults.hit_async("d.migrate_in_before_pull")
        t0 = time.monotonic()
        try:
            reused = await self.before_deadline(pull.finish(resume.kv))
        except KVTransferError as e:
            await pull.cancel()
            ctx.counters["transfer_failures"] += 1
            logger.warning("request %s: migration pull failed: %s", self.rid, e)
            raise PDServeError(
                ErrorCode.UNAVAILABLE, f"the migration's KV transfer failed ({e.reason})", self.rid
            ) from None
        ctx.counters["pulled_blocks"] += pull.num_pulled
        ctx.counters["reused_blocks"] += reused
        ctx.counters["migrated_in"] += 1
        await ctx.engine.kv_arrived(self.rid, ())
        self.phases["transfer_ms"] += (time.monotonic() - t0) * 1000

    def cached_tokens_so_far(self) -> int:
        """The prompt tokens whose compute a cache saved, as the final usage reports them."""
        if self.call.resume is not None:
            return self.call.resume.cached_tokens
        if self.prefill_mode == "remote" and self.remote_cached_tokens is not None:
            return self.remote_cached_tokens
        return self.local_cached_tokens

    def _record_tpot(self, out: RequestOutput) -> None:
        num_here = out.num_output_tokens - max(1, self.resumed_tokens)  # decoded by this engine
        if self.first_token_at is not None and num_here > 0:
            decode_s = time.monotonic() - self.first_token_at
            self.ctx.recent_tpot.add(decode_s * 1000 / num_here)

    def _chunk(self, out: RequestOutput) -> StreamChunk:
        self.local_cached_tokens = out.num_cached_tokens or self.local_cached_tokens
        if self.first_token_at is None and out.new_token_ids:
            self.first_token_at = time.monotonic()
            if self.prefill_mode == "local":
                sched = out.scheduled_time or self.arrival
                self.phases["decode_queue_ms"] = (sched - self.arrival) * 1000
                self.phases["prefill_ms"] = (self.first_token_at - sched) * 1000
        if out.finished:
            self.ended[out.index] = out
            self.finished = len(self.ended) == self.call.n
        first = out.index not in self.started and bool(out.new_token_ids)
        if first:
            self.started.add(out.index)
        return StreamChunk(
            request_id=self.rid,
            token_ids=list(out.new_token_ids),
            text=out.new_text,
            logprobs=out.new_logprobs,
            top_logprobs=out.new_top_logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            usage=self._final_usage(out) if self.finished else None,
            index=out.index,
            prompt_logprobs=self.prompt_logprobs if first else None,
        )

    def _final_usage(self, out: RequestOutput) -> Usage:
        """Once every sample ended: the prompt counts once, the outputs of all samples."""
        ended = self.ended.values()
        # A remote prefill's compute was saved by the prefill replica's cache; a local one's (or
        # a recompute's) by this replica's; a migrated request's, where it started.
        self.local_cached_tokens = out.num_cached_tokens
        if self.first_token_at is not None:
            decode_s = time.monotonic() - self.first_token_at
            self.phases["decode_ms"] = self.decode_ms_before + decode_s * 1000
        return Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=sum(o.num_output_tokens for o in ended),
            cached_tokens=self.cached_tokens_so_far(),
            prefill_mode=self.prefill_mode,
            phases=dict(self.phases),
            draft_tokens=sum(o.num_draft_tokens for o in ended),
            accepted_draft_tokens=sum(o.num_accepted_tokens for o in ended),
        )

    async def before_deadline(self, aw: Any) -> Any:
        return await within_deadline(aw, self.call.deadline, self.rid)


async def _let_end(stream: AsyncIterator[Any]) -> None:
    """A prefill call whose lease this side ended (the last pull's ack, or an abort): it ends
    once the sender reads that, usually long before the decode does. Closing it first would
    make the prefill replica abort a lease that was about to be acked (its counters then say
    ``aborted``, and the ack arrives stale), so give it a moment to end, then close it."""
    try:
        async with asyncio.timeout(CALL_END_WAIT_S):
            async for _ in stream:
                pass
    # Timed out, the prefill replica went away, or Serve cancelled the call along with this
    # request (its CancelledError is the call's, not this cleanup task's): it ends either way.
    except (Exception, asyncio.CancelledError):
        logger.debug("a prefill call did not end by itself", exc_info=True)
    await _aclose(stream)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        # A dead prefill replica's stream may fail to close, a call Serve cancelled with this
        # request raise CancelledError: either way it is gone.
        except (Exception, asyncio.CancelledError):
            logger.debug("closing a prefill stream failed", exc_info=True)


def merge_chunks(chunks: list[StreamChunk]) -> StreamChunk:
    """Consecutive chunks of one request as one (tokens, text, logprobs in order)."""
    if len(chunks) == 1:
        return chunks[0]
    first, last = chunks[0], chunks[-1]
    lps = [x for c in chunks for x in c.logprobs or []]
    tops = [x for c in chunks for x in c.top_logprobs or []]
    return StreamChunk(
        request_id=first.request_id,
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        logprobs=lps if first.logprobs is not None else None,
        top_logprobs=tops if first.top_logprobs is not None else None,
        finish_reason=last.finish_reason,
        usage=last.usage,
        index=first.index,
        prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs), None),
    )


def merge_by_sample(chunks: list[StreamChunk]) -> list[StreamChunk]:
    """Chunks of several samples as one chunk per sample, each sample's in order; the sample
    whose chunk came last (the one carrying the usage, if any) goes last."""
    by_index: dict[int, list[StreamChunk]] = {}
    last: dict[int, int] = {}
    for k, chunk in enumerate(chunks):
        by_index.setdefault(chunk.index, []).append(chunk)
        last[chunk.index] = k
    return [merge_chunks(by_index[i]) for i in sorted(by_index, key=last.__getitem__)]
