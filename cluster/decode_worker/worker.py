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

import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from cluster.common.faults import FaultPoints
from cluster.common.protocol import GenerateCall, StreamChunk
from cluster.config import ClusterConfig
from cluster.decode_worker.request_handoff import DecodeContext, PrefillClient, RequestHandoff
from cluster.engine.client import EngineClient
from cluster.engine.engine import LLMEngine
from cluster.kv_transfer import KVPool, KVReceiver
from cluster.serving.signals import RecentWindow

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
        self.engine = EngineClient(
            LLMEngine(self.config, role="decode"),
            name="decode-engine",
            before_step=lambda: self.faults.hit("engine.step"),
        )
        pool = KVPool(self.engine.kv_cache, self.engine.kv_layout)
        self.receiver = KVReceiver(self.config.transfer, pool, instance_id=instance_id)
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
        }
        self._ctx = DecodeContext(
            self.config,
            self.engine,
            self.receiver,
            prefill_client,
            self.faults,
            self.counters,
            self.recent_tpot,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> DecodeWorker:
        self.receiver.start()
        self.engine.start()
        return self

    def close(self) -> None:
        self.engine.stop()
        self.receiver.close()

    def is_alive(self) -> bool:
        return self.engine.is_alive() and self.receiver.is_alive()

    # -- the call -----------------------------------------------------------------------------

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamChunk]:
        seed = call.params.seed if call.params.seed is not None else self._rng.getrandbits(63)
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
            "recent_tpot_ms": self.recent_tpot.median(),
            "peak_running": self.engine.peak_running,
            "handoff_stages": dict(Counter(h.stage for h in self._ctx.live)),
            **self.counters,
        }
