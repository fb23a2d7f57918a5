"""The prefill pool's core (Ray-free): an engine in the prefill role, a KV sender, and leases.

Lifecycle of one request (``prefill(call)`` is an async stream):
  1. The request joins the engine with the decode side's seed, so the first token is the one a
     single-process run would draw.
  2. When its prefill completes the engine samples the first token; the prefill hand-off ends
     the request there and holds its blocks (not freed, not evictable). That output carries
     the held block table.
  3. The blocks are leased to the KV sender, which returns the ``KVTransferParams`` handle.
  4. The stream yields ``PrefillReply(first token, handle)`` at once, then stays open: the
     caller (and Ray Serve) sees the leased work as ongoing.
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
from cluster.common.protocol import PrefillCall, PrefillProgress, PrefillReply
from cluster.config import ClusterConfig
from cluster.engine.client import EngineClient
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.runner_registry import create_runner
from cluster.engine.step_loop import EngineDeadError
from cluster.kv_transfer import KVPool, KVSender, KVTransferParams
from cluster.serving.signals import RecentWindow

logger = logging.getLogger(__name__)

# Per call with a lease out (or about to): its loop, the event the lease's end sets, its outputs.
_CallState = tuple[asyncio.AbstractEventLoop, asyncio.Event, "asyncio.Queue[RequestOutput | None]"]


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
        shared = device.type == "cpu" and "shm" in self.config.transfer.transports
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
        if call.kv_layout is None:
            return
        assert self._pool is not None
        try:
            mismatch = self._pool.layout.mismatch(KVLayout(**call.kv_layout))  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            mismatch = f"unreadable layout ({e})"
        if mismatch is not None:
            raise PDServeError(
                ErrorCode.INTERNAL,
                f"KV layout mismatch between the pools, the prefill pool refuses the hand-off: "
                f"{mismatch}",
                call.request_id,
            )

    async def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillProgress | PrefillReply]:
        aloop = asyncio.get_running_loop()
        arrival = time.monotonic()
        # An internal id per call: a retried request never collides with a lease still held.
        rid = f"{call.request_id}#{uuid.uuid4().hex[:8]}"
        outputs: asyncio.Queue[RequestOutput | None] = asyncio.Queue()  # None: the lease ended

        def sink(out: RequestOutput) -> None:
            aloop.call_soon_threadsafe(outputs.put_nowait, out)

        self._check_layout(call)
        ended = asyncio.Event()  # set by the sender thread when the lease ends
        # No lease out yet: an abort frees the request wherever it is. Once leased, the lease's
        # release frees its blocks (and ends the request if it still prefills).
        in_engine = True
        leased = False
        self._leases[rid] = (aloop, ended, outputs)
        try:
            try:
                await self.engine.add(
                    rid, call.prompt_token_ids, call.params, sink, seed=call.seed, n=call.n
                )
            except ValueError as e:
                in_engine = False
                raise PDServeError(ErrorCode.INVALID_ARGUMENT, str(e), call.request_id) from None
            except EngineDeadError:  # its step failed: Serve replaces this replica
                in_engine = False
                raise PDServeError(
                    ErrorCode.UNAVAILABLE, "the prefill replica is unavailable", call.request_id
                ) from None
            samples: list[RequestOutput] = []  # samples' first tokens (a full last block)
            while True:
                out = await outputs.get()
                if out is not None and out.index > 0:
                    if out.new_token_ids:  # the same step's, just before the leader's
                        samples.append(out)
                    continue
                if out is None or out.streamed_block_ids is None:
                    break
                progress = self._stream(rid, call, out.streamed_block_ids, leased)
                in_engine, leased = False, True
                yield progress
            if out is not None and out.error is not None:  # its text stays in this log
                logger.error("request %s: %s", call.request_id, out.error)
                raise PDServeError(
                    ErrorCode.UNAVAILABLE, "the prefill replica failed", call.request_id
                )
            if out is None or (out.finished and not out.new_token_ids):
                raise PDServeError(
                    ErrorCode.UNAVAILABLE,
                    "the KV lease ended while the prompt was prefilling",
                    call.request_id,
                )
            self.num_prefills += 1
            reply = self._reply(call, out, arrival)
            reply.sample_first_tokens = [_first(o) for o in sorted(samples, key=_index)]
            if out.held_block_ids is None:  # the first token finished it: nothing to pull
                in_engine = False  # a streamed prompt's pins go with its lease, aborted below
                yield reply
                return
            await self.faults.hit_async("p.after_prefill_before_publish")
            params = self._publish(rid, call, out.held_block_ids, leased)
            in_engine, leased = False, True
            await self.faults.hit_async("p.after_publish_before_send")
            reply.kv = params.to_dict()
            yield reply
            await ended.wait()
        finally:
            if in_engine:
                self.engine.abort(rid)
            elif leased and not ended.is_set():
                self.sender.abort(rid)  # the release callback frees the blocks
            self._leases.pop(rid, None)

    def _stream(
        self, rid: str, call: PrefillCall, block_ids: list[int], leased: bool
    ) -> PrefillProgress:
        """A streamed prompt's blocks so far: lease them (or grow the lease) and announce."""
        num_tokens = len(block_ids) * self.engine.block_size
        hashes = call.block_hashes[: len(block_ids)]
        if not leased:
            params = self.sender.register(
                rid, block_ids, num_tokens=num_tokens, block_hashes=hashes, streamed=True
            )
        else:
            extended = self.sender.extend(
                rid, block_ids, num_tokens=num_tokens, block_hashes=hashes
            )
            if extended is None:
                raise self._lease_gone(call)
            params = extended
        return PrefillProgress(call.request_id, params.to_dict())

    def _publish(
        self, rid: str, call: PrefillCall, held: list[int], leased: bool
    ) -> KVTransferParams:
        """The first token's held table: lease it, or seal a streamed prompt's lease with it."""
        hashes = call.block_hashes[: len(held)]
        num_tokens = len(call.prompt_token_ids)
        if not leased:
            return self.sender.register(rid, held, num_tokens=num_tokens, block_hashes=hashes)
        params = self.sender.extend(
            rid, held, num_tokens=num_tokens, block_hashes=hashes, last=True
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

    def _reply(self, call: PrefillCall, out: RequestOutput, arrival: float) -> PrefillReply:
        # (queue, compute) milliseconds: arrival -> scheduled -> first token.
        scheduled = out.scheduled_time if out.scheduled_time is not None else arrival
        first = out.first_token_time if out.first_token_time is not None else time.monotonic()
        queue_ms = max(0.0, (scheduled - arrival) * 1000)
        prefill_ms = max(0.0, (first - scheduled) * 1000)
        self.recent_ttft.add(queue_ms + prefill_ms)
        return PrefillReply(
            request_id=call.request_id,
            first_token_id=out.new_token_ids[0],
            first_logprob=_first(out)[1],
            first_top_logprobs=_first(out)[2],
            kv=None,
            finish_reason=out.finish_reason,
            num_cached_tokens=out.num_cached_tokens,
            prefill_queue_ms=queue_ms,
            prefill_ms=prefill_ms,
            first_text=out.new_text,
        )

    def _on_release(self, request_id: str, reason: str) -> None:
        """KV sender thread: a lease ended. Free the blocks on the engine thread, wake the call."""
        self.engine.release(request_id)
        lease = self._leases.get(request_id)
        if lease is not None:
            logger.debug("request %s: lease ended (%s)", request_id, reason)
            aloop, ended, outputs = lease
            aloop.call_soon_threadsafe(ended.set)
            aloop.call_soon_threadsafe(outputs.put_nowait, None)

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


def _first(out: RequestOutput) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    """An output's first token, with its logprob and top logprobs when asked for."""
    lp = out.new_logprobs[0] if out.new_logprobs else None
    return out.new_token_ids[0], lp, out.new_top_logprobs[0] if out.new_top_logprobs else None


def _index(out: RequestOutput) -> int:
    return out.index
