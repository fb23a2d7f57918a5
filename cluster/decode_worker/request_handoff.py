"""``RequestHandoff``: one request's prefill/decode hand-off and token stream on a decode replica.

``stream()`` is the whole life of the request here (see ``worker`` for the numbered lifecycle):
add it to the engine (which says local or remote), run the remote hand-off if needed (block
reservation, prefill call, first token, pull, ``kv_arrived``), then relay the engine's outputs as
``StreamChunk``s until it finishes. Whatever way the stream ends, ``finally`` leaves nothing
behind: the reservation, the pull (and with it the prefill side's lease), the prefill call and
the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.faults import FaultPoints
from cluster.common.protocol import (
    GenerateCall,
    PrefillCall,
    PrefillProgress,
    PrefillReply,
    StreamChunk,
    Usage,
)
from cluster.config import ClusterConfig
from cluster.decode_worker.kv_pull import KVPull
from cluster.engine.client import Added, EngineClient
from cluster.engine.engine import RequestOutput
from cluster.engine.handoff import KVReservation
from cluster.engine.parallel import sample_ids
from cluster.engine.step_loop import EngineDeadError
from cluster.kv_transfer import KVReceiver, KVTransferError, KVTransferParams
from cluster.serving.calls import within_deadline
from cluster.serving.signals import RecentWindow

logger = logging.getLogger(__name__)
# How long a finished request waits for its prefill call to end by itself (the prefill replica
# reads the ack in about a millisecond; it is usually done before the decode is).
CALL_END_WAIT_S = 0.5


class PrefillClient(Protocol):
    """How a decode replica reaches the prefill pool (Ray Serve handle, or a test harness)."""

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillProgress | PrefillReply]: ...


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


class RequestHandoff:
    def __init__(self, ctx: DecodeContext, call: GenerateCall, seed: int) -> None:
        self.ctx = ctx
        self.call = call
        self.seed = seed
        self.rid = call.request_id
        self.arrival = time.monotonic()
        self.outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.usage = Usage(prefill_mode="local")
        self.usage.phases["router_queue_ms"] = call.router_queue_ms
        self.first_token_at: float | None = None
        self.finished = False  # every sample ended (or the request failed)
        self.ended: dict[int, RequestOutput] = {}  # each finished sample's last output
        self.in_engine = False
        self.pull: KVPull | None = None  # the prompt's KV, pulled into its reservation
        self.remote_cached_tokens: int | None = None
        self.failure: str | None = None  # why the hand-off failed the request, in client words
        self.prompt_logprobs: list[Any] | None = None  # sample 0's, sent with each one's first
        self.started: set[int] = set()  # samples whose first chunk went out
        self.stage = "adding"  # adding, blocks, prefill, first_token, pull, decode, ending

    async def stream(self) -> AsyncGenerator[StreamChunk, None]:
        ctx = self.ctx
        aloop = asyncio.get_running_loop()
        prefill_stream: AsyncIterator[PrefillProgress | PrefillReply] | None = None
        added: Added | None = None
        ctx.live.add(self)
        try:
            added = await self._add(aloop)
            if added.remote:
                self.usage.prefill_mode = "remote"
                ctx.counters["remote_prefills"] += 1
                assert ctx.prefill_client is not None and added.reservation is not None
                self.pull = KVPull(ctx.receiver, added.reservation)
                self.stage = "blocks"
                # Blocks here first, then the prefill: a prefill replica's pool then only ever
                # holds KV that has somewhere to go. (Prefilling while waiting for blocks here
                # deadlocks two full pools: these blocks reserved for prompts that cannot
                # prefill, that pool full of prompts waiting for blocks here.)
                await self._before_deadline(asyncio.shield(added.reservation))
                self.stage = "prefill"
                prefill_stream = ctx.prefill_client.prefill(self._prefill_call())
                async with contextlib.aclosing(
                    self._remote_handoff(prefill_stream, added.reservation)
                ) as chunks:
                    async for chunk in chunks:
                        yield chunk
            else:
                ctx.counters["local_prefills"] += 1
            if not self.finished:  # a remote first token may already have ended it
                self.stage = "decode"
                async with contextlib.aclosing(self._decode()) as chunks:
                    async for chunk in chunks:
                        yield chunk
        except EngineDeadError:  # a step failed (entry 2 or 3): the router retries or aborts
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "the decode replica is unavailable", self.rid
            ) from None
        finally:
            # In a task of its own: a cancellation that lands on one of its awaits (a client
            # gone while the stream was already closing) must not skip the engine's abort.
            self.stage = "ending"
            await asyncio.shield(asyncio.ensure_future(self._end(added, prefill_stream)))

    async def _end(
        self,
        added: Added | None,
        prefill_stream: AsyncIterator[PrefillProgress | PrefillReply] | None,
    ) -> None:
        """Leave nothing behind: the reservation, the pull (and with it the prefill side's
        lease), the request in the engine, the prefill call."""
        try:
            if added is not None and added.reservation is not None:
                added.reservation.cancel()
            if self.pull is not None:  # tells the prefill side to free its blocks, and waits
                await self.pull.cancel()  # until no pull writes the reserved ones any more
            # Before the prefill call closes: however that ends, the engine's blocks go.
            if self.in_engine and not self.finished:
                self.ctx.engine.abort(self.rid)
            if prefill_stream is not None:
                if self.pull is not None and self.pull.finished:
                    await _let_end(prefill_stream)
                else:
                    await _aclose(prefill_stream)
        finally:
            self.ctx.live.discard(self)

    async def _add(self, aloop: asyncio.AbstractEventLoop) -> Added:
        ctx = self.ctx
        try:
            added = await ctx.engine.add(
                self.rid,
                self.call.prompt_token_ids,
                self.call.params,
                self._sink(aloop),
                prefill="auto" if ctx.prefill_client is not None else "local",
                seed=self.seed,
                arrival_time=self.arrival,
                n=self.call.n,
            )
        except ValueError as e:
            code = ErrorCode.ALREADY_EXISTS if "already exists" in str(e) else None
            raise PDServeError(code or ErrorCode.INVALID_ARGUMENT, str(e), self.rid) from None
        except EngineDeadError:  # its step failed: Serve replaces this replica; retry elsewhere
            raise PDServeError(
                ErrorCode.UNAVAILABLE, "the decode replica is unavailable", self.rid
            ) from None
        self.in_engine = True
        return added

    def _sink(self, aloop: asyncio.AbstractEventLoop) -> Callable[[RequestOutput], None]:
        """Engine thread -> this request's queue on its event loop (never blocks)."""

        def sink(out: RequestOutput) -> None:
            aloop.call_soon_threadsafe(self.outputs.put_nowait, out)

        return sink

    def _prefill_call(self) -> PrefillCall:
        return PrefillCall(
            request_id=self.rid,
            prompt_token_ids=self.call.prompt_token_ids,
            block_hashes=self.call.block_hashes,
            params=self.call.params,
            seed=self.seed,
            decode_endpoint=self.ctx.receiver.instance_id,
            deadline=self.call.deadline,
            kv_layout=self.ctx.receiver.pool.layout.to_dict(),
            n=self.call.n,
        )

    async def _remote_handoff(
        self,
        prefill_stream: AsyncIterator[PrefillProgress | PrefillReply],
        reservation: asyncio.Future[KVReservation],
    ) -> AsyncGenerator[StreamChunk, None]:
        ctx = self.ctx
        pull = self.pull
        assert pull is not None
        try:
            reply = await self._prefill_reply(prefill_stream, pull)
        except PDServeError as e:
            await pull.cancel()  # a streamed part may be landing in the reserved blocks
            if e.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.DEADLINE_EXCEEDED):
                raise
            # a PDServeError's message is written for clients (a KV layout mismatch names both)
            await self._fail_or_recompute(e.message, f"{e.code.value}: {e.message}")
            return
        except (StopAsyncIteration, Exception) as e:  # a dead or unreachable prefill replica
            await pull.cancel()
            ctx.counters["prefill_call_failures"] += 1
            await self._fail_or_recompute("prefill call failed", f"{type(e).__name__}: {e}")
            return
        self.usage.phases["prefill_queue_ms"] = reply.prefill_queue_ms
        self.usage.phases["prefill_ms"] = reply.prefill_ms
        self.remote_cached_tokens = reply.num_cached_tokens
        if reply.kv is None:
            await pull.cancel()  # nothing (more) to pull: stop streamed parts before any free
        self.stage = "first_token"
        early = self._early_first(reply)
        if early is not None:  # the first token now, not once this engine's step is over
            yield self._chunk(early)
        first = await ctx.engine.accept_first_token(
            self.rid, reply.first_token_id, reply.first_logprob, reply.first_top_logprobs
        )
        if early is None:
            yield self._chunk(first)  # the first token, before any (more) KV moves
        else:
            rest = self._after_early(early, first)
            if rest is not None:
                yield self._chunk(rest)
        # The samples' first tokens (a full last block): they then share every prompt block.
        for sid, (token, lp, top) in zip(
            sample_ids(self.rid, self.call.n)[1:], reply.sample_first_tokens, strict=False
        ):
            yield self._chunk(await ctx.engine.accept_first_token(sid, token, lp, top))
        if first.finished or reply.kv is None:
            return
        await self._pull(KVTransferParams.from_dict(reply.kv), reservation, pull)

    def _early_first(self, reply: PrefillReply) -> RequestOutput | None:
        """The first token's output as this engine will compute it, from the prefill
        replica's reply (which carries its text): it goes to the client while this engine is
        still busy with a step. None when the token ends the request (the engine ends it)."""
        if reply.first_text is None or reply.finish_reason is not None:
            return None
        with_logprobs = reply.first_logprob is not None and self.call.params.logprobs is not None
        return RequestOutput(
            self.rid,
            [reply.first_token_id],
            reply.first_text,
            finished=False,
            new_logprobs=[reply.first_logprob or 0.0] if with_logprobs else None,
            new_top_logprobs=[reply.first_top_logprobs or []] if with_logprobs else None,
            num_output_tokens=1,
        )

    def _after_early(self, early: RequestOutput, first: RequestOutput) -> RequestOutput | None:
        """What this engine's output for the first token adds to the early one sent: nothing,
        or (never expected: both engines run the same code on the same token) the end."""
        same = first.new_token_ids == early.new_token_ids and first.new_text == early.new_text
        if same and not first.finished:
            return None
        logger.error(
            "request %s: the decode engine's first token %r (%r, finished=%s) differs from the "
            "prefill replica's %r (%r)",
            self.rid,
            first.new_token_ids,
            first.new_text,
            first.finished,
            early.new_token_ids,
            early.new_text,
        )
        extra = first.new_text[len(early.new_text) :]
        if not first.new_text.startswith(early.new_text):
            extra = ""  # sent text cannot be taken back
        if not extra and not first.finished:
            return None
        return dataclasses.replace(
            first, new_token_ids=[], new_text=extra, new_logprobs=None, new_top_logprobs=None
        )

    async def _prefill_reply(
        self, prefill_stream: AsyncIterator[PrefillProgress | PrefillReply], pull: KVPull
    ) -> PrefillReply:
        """The prefill call's reply; a streamed prompt's announced blocks start moving first."""
        while True:
            item = await self._before_deadline(prefill_stream.__anext__())
            if not isinstance(item, PrefillProgress):
                return item
            pull.offer(KVTransferParams.from_dict(item.kv))

    async def _pull(
        self, kv: KVTransferParams, reservation: asyncio.Future[KVReservation], pull: KVPull
    ) -> None:
        ctx = self.ctx
        pull.hold(kv)  # heartbeat the lease while the request waits for blocks
        self.stage = "pull"
        await self._before_deadline(asyncio.shield(reservation))
        self.usage.phases["decode_queue_ms"] = (time.monotonic() - self.arrival) * 1000
        await ctx.faults.hit_async("d.after_alloc_before_pull")
        t0 = time.monotonic()
        try:
            reused = await self._before_deadline(pull.finish(kv))
        except KVTransferError as e:
            await pull.cancel()
            ctx.counters["transfer_failures"] += 1
            await self._fail_or_recompute(f"KV transfer failed ({e.reason})", str(e))
            return
        ctx.counters["pulled_blocks"] += pull.num_pulled
        ctx.counters["streamed_parts"] += pull.num_parts
        ctx.counters["reused_blocks"] += reused
        self.usage.phases["transfer_ms"] = (time.monotonic() - t0) * 1000
        await ctx.engine.kv_arrived(self.rid)

    async def _fail_or_recompute(self, what: str, detail: str) -> None:
        """``what`` is all a client may see (no exception text, address or path: S8); the
        ``detail`` stays in this replica's log."""
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
            self.usage.prefill_mode = "local"
        else:
            self.failure = what
        await ctx.engine.kv_failed(self.rid, recompute=recompute, error=what)

    async def _decode(self) -> AsyncGenerator[StreamChunk, None]:
        while True:
            outs = await self._next_outputs()
            error = outs.pop() if outs[-1].error is not None else None
            if outs:
                for out in outs:  # (sample 0's prompt logprobs, for every sample's first chunk)
                    self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
                    for _ in out.new_token_ids:
                        await self.ctx.faults.hit_async("d.mid_decode_token_k")
                chunks = [self._chunk(out) for out in outs]
                for out in outs:
                    if out.finished:
                        self._record_tpot(out)
                for chunk in merge_by_sample(chunks):
                    yield chunk
                if self.finished:
                    return
            if error is not None:
                self.finished = True
                code = ErrorCode.ABORTED if self.first_token_at else ErrorCode.UNAVAILABLE
                if self.failure is None:  # the engine itself failed: its text stays here
                    logger.error("request %s: %s", self.rid, error.error)
                raise PDServeError(code, self.failure or "the decode replica failed", self.rid)

    async def _next_outputs(self) -> list[RequestOutput]:
        """The next output, and every one already queued behind it (to its last, or an error):
        when this replica falls behind its engine, one chunk carries several steps' tokens, so
        the per-item cost of the streams (here, Ray, the router) does not grow with the load."""
        outs = [await self._before_deadline(self.outputs.get())]
        while not outs[-1].finished and not self.outputs.empty():
            outs.append(self.outputs.get_nowait())
        return outs

    def _record_tpot(self, out: RequestOutput) -> None:
        if self.first_token_at is not None and out.num_output_tokens > 1:
            decode_s = time.monotonic() - self.first_token_at
            self.ctx.recent_tpot.add(decode_s * 1000 / (out.num_output_tokens - 1))

    def _chunk(self, out: RequestOutput) -> StreamChunk:
        if self.first_token_at is None and out.new_token_ids:
            self.first_token_at = time.monotonic()
            if self.usage.prefill_mode == "local":
                sched = out.scheduled_time or self.arrival
                self.usage.phases["decode_queue_ms"] = (sched - self.arrival) * 1000
                self.usage.phases["prefill_ms"] = (self.first_token_at - sched) * 1000
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
        u = self.usage
        ended = self.ended.values()
        u.prompt_tokens = out.num_prompt_tokens
        u.completion_tokens = sum(o.num_output_tokens for o in ended)
        # A remote prefill's compute was saved by the prefill replica's cache; a local one's (or
        # a recompute's) by this replica's.
        remote = self.remote_cached_tokens if u.prefill_mode == "remote" else None
        u.cached_tokens = out.num_cached_tokens if remote is None else remote
        u.draft_tokens = sum(o.num_draft_tokens for o in ended)
        u.accepted_draft_tokens = sum(o.num_accepted_tokens for o in ended)
        if self.first_token_at is not None:
            u.phases["decode_ms"] = (time.monotonic() - self.first_token_at) * 1000
        return u

    async def _before_deadline(self, aw: Any) -> Any:
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
