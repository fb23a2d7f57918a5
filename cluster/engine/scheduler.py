"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step:
  1. Running requests, oldest first, get their next tokens (one for a decode, a chunk for a
     prefill) under the token budget. If blocks run out, the newest running request is
     preempted (blocks freed, recomputed later); a request may preempt itself.
  2. Decode role: requests waiting for remote KV get blocks reserved, oldest first.
  3. If nothing was preempted, waiting requests are admitted in arrival order (FCFS) while the
     budget, ``max_num_seqs`` and the pool allow; the first that does not fit stops admission.
     A waiting request whose next uncached block a running request is computing right now is
     passed over until that block is published (in-flight prefix dedup: two requests of one
     prefix arriving together compute it once, the second hits the cache a step later).

A request's state is its counters: it needs ``num_tokens - num_computed_tokens`` more tokens of
KV, and a step that completes them ends in a sampled token. The scheduler never touches tensors;
it hands the runner a plain ``ScheduledBatch``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # fed this step, from request.num_computed_tokens on
    block_ids: list[int]  # the request's live block table (read-only for the runner)

    @property
    def samples(self) -> bool:
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(slots=True)
class KVReservation:
    """Decode role: blocks reserved for a request whose prompt KV comes from a prefill replica."""

    request_id: str
    block_ids: list[int]  # the whole table (prefix hits first)
    num_hit_blocks: int  # leading blocks already cached here: they need no transfer


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    reservations: list[KVReservation] = field(default_factory=list)
    num_deferred: int = 0  # waiting requests held back for a prefix block being computed

    @property
    def is_empty(self) -> bool:
        return not self.items


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, force_preempt_interval: int = 0
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kv_waiting: deque[Request] = deque()  # decode role: no blocks yet
        self.kv_reserved: dict[str, Request] = {}  # decode role: blocks reserved, KV in flight
        self.held: dict[str, Request] = {}  # prefill role: finished, blocks kept for a pull
        self._force_preempt_interval = force_preempt_interval
        self._num_steps = 0
        self.num_preemptions = 0

    # -- intake -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_kv_pending(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_KV
        self.kv_waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.kv_waiting) + len(self.kv_reserved)

    # -- the step -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self._num_steps += 1
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        if self._force_preempt_interval and self._num_steps % self._force_preempt_interval == 0:
            if self.running:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted_ids.append(victim.request_id)

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_tokens_to_schedule(req, budget)
            if n == 0:
                i += 1
                continue
            if not self._ensure_blocks(req, n, batch):
                break  # req preempted itself; everything after it is gone too
            batch.items.append(
                ScheduledRequest(req, n, self.block_manager.block_table(req.request_id))
            )
            budget -= n
            i += 1

        # 2. Decode role: reserve blocks for requests whose KV will be pulled.
        while self.kv_waiting and not batch.preempted_ids:
            if len(self.running) + len(self.kv_reserved) >= cfg.max_num_seqs:
                break
            reservation = self._reserve(self.kv_waiting[0])
            if reservation is None:
                break
            req = self.kv_waiting.popleft()
            req.scheduled_time = time.monotonic()
            self.kv_reserved[req.request_id] = req
            batch.reservations.append(reservation)

        # 3. Admit waiting requests in arrival order. One whose next uncached block another
        # request is computing right now waits for it (a step or a few), then hits the cache,
        # rather than computing the same prefix twice; the requests behind it go on.
        pending = self._blocks_in_progress() if self.block_manager.enable_caching else set()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and not batch.preempted_ids:
            if len(self.running) >= cfg.max_num_seqs:
                break
            req = self.waiting[0]
            if pending and self._needs_pending_block(req, pending):
                deferred.append(self.waiting.popleft())
                continue
            n = self._admit(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.items.append(
                ScheduledRequest(req, n, self.block_manager.block_table(req.request_id))
            )
            budget -= n
            if self.block_manager.enable_caching:
                pending.update(self._uncomputed_full_blocks(req))
        self.waiting.extendleft(reversed(deferred))
        batch.num_deferred = len(deferred)

        batch.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return batch

    def _uncomputed_full_blocks(self, req: Request) -> list[int]:
        """Hashes of the full blocks ``req`` has yet to compute (published as they finish)."""
        hashes = req.update_block_hashes(self.block_size)
        return hashes[req.num_computed_tokens // self.block_size :]

    def _blocks_in_progress(self) -> set[int]:
        pending: set[int] = set()
        for req in self.running:
            pending.update(self._uncomputed_full_blocks(req))
        return pending

    def _needs_pending_block(self, req: Request, pending: set[int]) -> bool:
        """Whether the first block ``req`` would compute is one a running request computes."""
        bm = self.block_manager
        if bm.has_table(req.request_id):
            return False  # decode role, KV arrived: nothing of the prompt left to compute
        tokens = req.all_token_ids
        hashes = req.update_block_hashes(self.block_size)
        max_hit_blocks = (len(tokens) - 1) // self.block_size
        if max_hit_blocks == 0:
            return False
        n = len(bm.match_prefix(hashes[:max_hit_blocks], tokens))
        return n < max_hit_blocks and hashes[n] in pending

    def _num_tokens_to_schedule(self, req: Request, budget: int) -> int:
        n = req.num_uncomputed_tokens
        chunk = self.config.chunk_size
        if chunk is None:
            return n if n <= budget else 0  # no chunking: all of it or nothing this step
        return min(n, chunk, budget)

    def _ensure_blocks(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``n`` more tokens of ``req``, preempting the newest others if needed."""
        bm = self.block_manager
        table = bm.block_table(req.request_id)
        needed = bm.blocks_needed(req.num_computed_tokens + n) - len(table)
        while needed > bm.num_free_blocks:
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        if needed > 0:
            bm.append_blocks(req.request_id, needed)
        return True

    def _admit(self, req: Request, budget: int) -> int:
        """Allocate blocks for a waiting request's first chunk; 0 if it cannot start now."""
        bm = self.block_manager
        if bm.has_table(req.request_id):
            # Decode role, KV arrived: only the first sampled token remains to be fed.
            n = self._num_tokens_to_schedule(req, budget)
            if n == 0:
                return 0
            needed = bm.blocks_needed(req.num_computed_tokens + n) - len(
                bm.block_table(req.request_id)
            )
            if needed > bm.num_free_blocks:
                return 0
            if needed > 0:
                bm.append_blocks(req.request_id, needed)
            return n
        tokens = req.all_token_ids
        hashes = req.update_block_hashes(self.block_size)
        # Keep at least one token to compute: its logits give the next token.
        max_hit_blocks = (len(tokens) - 1) // self.block_size
        hits = bm.match_prefix(hashes[:max_hit_blocks], tokens)
        num_hit_tokens = len(hits) * self.block_size
        remaining = len(tokens) - num_hit_tokens
        chunk = self.config.chunk_size
        if chunk is None:
            if remaining > budget:
                return 0
            n = remaining
        else:
            n = min(remaining, chunk, budget)
        needed = bm.blocks_needed(num_hit_tokens + n) - len(hits)
        if not bm.can_allocate(needed, hits):
            return 0
        bm.allocate(req.request_id, needed, hits)
        req.num_computed_tokens = num_hit_tokens
        req.num_cached_tokens = num_hit_tokens
        return n

    def _reserve(self, req: Request) -> KVReservation | None:
        bm = self.block_manager
        hashes = req.update_block_hashes(self.block_size)
        hits = bm.match_prefix(hashes, req.prompt_token_ids)
        needed = bm.blocks_needed(req.num_prompt_tokens) - len(hits)
        if not bm.can_allocate(needed, hits):
            return None
        table = bm.allocate(req.request_id, needed, hits)
        req.num_cached_tokens = len(hits) * self.block_size
        return KVReservation(req.request_id, list(table), len(hits))

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the step -----------------------------------------------------------------------

    def kv_arrived(self, request_id: str) -> Request:
        """Decode role: the prompt's KV is in the reserved blocks; decoding may start."""
        req = self.kv_reserved.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.cache_blocks(
            request_id,
            req.update_block_hashes(self.block_size),
            req.all_token_ids,
            req.num_computed_tokens,
        )
        self._insert_waiting_by_arrival(req)
        return req

    def kv_failed_recompute(self, request_id: str) -> Request:
        """Decode role: the transfer (or the prefill call) failed; prefill locally instead."""
        req = self.kv_reserved.pop(request_id, None)
        if req is None:  # not reserved yet: it holds no blocks
            req = next(r for r in self.kv_waiting if r.request_id == request_id)
            self.kv_waiting.remove(req)
        else:
            self.block_manager.free(request_id)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        self._insert_waiting_by_arrival(req)
        return req

    def _insert_waiting_by_arrival(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        idx = len(self.waiting)
        while idx > 0 and self.waiting[idx - 1].arrival_time > req.arrival_time:
            idx -= 1
        self.waiting.insert(idx, req)

    def commit(self, item: ScheduledRequest) -> None:
        """Record that the step computed ``item``'s tokens, and publish its full blocks."""
        req = item.request
        req.num_computed_tokens += item.num_new_tokens
        bm = self.block_manager
        if bm.enable_caching and req.num_computed_tokens >= self.block_size:
            hashes = req.update_block_hashes(self.block_size)
            bm.cache_blocks(req.request_id, hashes, req.all_token_ids, req.num_computed_tokens)

    def finish(self, req: Request, status: RequestStatus, hold_blocks: bool = False) -> None:
        """End a request wherever it is; free its blocks unless a pull will need them."""
        assert status.is_finished
        rid = req.request_id
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_KV:
            if rid in self.kv_reserved:
                del self.kv_reserved[rid]
            else:
                self.kv_waiting.remove(req)
        req.status = status
        if hold_blocks and self.block_manager.has_table(rid):
            self.held[rid] = req
        elif self.block_manager.has_table(rid):
            self.block_manager.free(rid)

    def release_held(self, request_id: str) -> bool:
        """Prefill role: the blocks were pulled (or the lease ended); free them."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.block_manager.free(request_id)
        return True

    def all_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting
        yield from self.kv_waiting
        yield from self.kv_reserved.values()
