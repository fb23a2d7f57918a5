"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step:
  1. Running requests, oldest first, get their next tokens (one for a decode, a chunk for a
     prefill; a decode with drafts, 1 + its drafts, as many as the budget and spare blocks
     allow) under the token budget. If blocks run out, the newest running request is
     preempted (blocks freed, recomputed later); a request may preempt itself.
  2. The role's hand-off reserves blocks for the requests it keeps (decode role: KV to pull).
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
from collections.abc import Iterable, Mapping, Sequence

from cluster.config import SchedulerConfig
from cluster.engine.batch import ScheduledBatch, ScheduledRequest
from cluster.engine.block_manager import BlockManager
from cluster.engine.handoff import Handoff, KVReservation
from cluster.engine.request import Request, RequestStatus

__all__ = ["ScheduledBatch", "ScheduledRequest", "Scheduler"]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, handoff: Handoff
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.handoff = handoff
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request by arrival time (a new one goes last; one handed back, in its place)."""
        request.status = RequestStatus.WAITING
        idx = len(self.waiting)
        while idx > 0 and self.waiting[idx - 1].arrival_time > request.arrival_time:
            idx -= 1
        self.waiting.insert(idx, request)

    def reserve_between_steps(self) -> list[KVReservation]:
        """The hand-off's reservations now, from what the running batch's next step leaves free
        (its requests' chunks or tokens within the budget; drafts only use spare blocks)."""
        bm, budget, keep = self.block_manager, self.config.max_num_batched_tokens, 0
        for req in self.running:
            n = self._fit(req.num_uncomputed_tokens, max(budget, 0))
            keep += bm.blocks_to_grow(req.request_id, req.num_computed_tokens + n)
            budget -= n
        return self.handoff.reserve(len(self.running), self.config.max_num_seqs, keep_free=keep)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step -----------------------------------------------------------------------------

    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> ScheduledBatch:
        """``drafts``: proposed next tokens of decoding running requests, verified this step."""
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        i = 0  # 1. Running requests, oldest first; a decode with drafts feeds 1 + k tokens.
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_tokens_to_schedule(req, budget)
            d = self._fit_drafts(req, drafts.get(req.request_id, ()), budget - n) if drafts else []
            if n and not self._ensure_blocks(req, n + len(d), batch):
                break  # req preempted itself; everything after it is gone too
            if n:
                batch.items.append(self._item(req, n + len(d), d))
                budget -= n + len(d)
            i += 1
        if batch.preempted_ids:
            return self._close(batch, budget)
        # 2. The role's hand-off: decode reserves blocks for KV that will be pulled.
        batch.reservations = self.handoff.reserve(len(self.running), cfg.max_num_seqs)
        # 3. Admit waiting requests in arrival order. One whose next uncached block another
        # request is computing right now waits for it (a step or a few), then hits the cache,
        # rather than computing the same prefix twice; the requests behind it go on.
        pending = self._blocks_in_progress()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
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
            batch.items.append(self._item(req, n))
            budget -= n
            pending.update(self._uncomputed_full_blocks(req))
        self.waiting.extendleft(reversed(deferred))
        batch.num_deferred = len(deferred)
        return self._close(batch, budget)

    def _item(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledRequest:
        table = self.block_manager.block_table(req.request_id)
        return ScheduledRequest(req, n, table, drafts or [])

    def _fit_drafts(self, req: Request, drafts: Sequence[int], budget: int) -> list[int]:
        """The drafts the budget and the free slots allow, leaving a block for every other
        running request's next token: drafts never cause a preemption."""
        if not drafts or req.num_uncomputed_tokens != 1:
            return []
        bm = self.block_manager
        spare = max(0, bm.num_free_blocks - len(self.running))
        slots = (len(bm.block_table(req.request_id)) + spare) * self.block_size
        return list(drafts[: max(0, min(budget, slots - req.num_tokens))])

    def _close(self, batch: ScheduledBatch, budget: int) -> ScheduledBatch:
        batch.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return batch

    def _num_tokens_to_schedule(self, req: Request, budget: int) -> int:
        return self._fit(req.num_uncomputed_tokens, budget)

    def _fit(self, n: int, budget: int) -> int:
        """How many of ``n`` tokens to feed this step: a chunk, or all or nothing unchunked."""
        chunk = self.config.chunk_size
        if chunk is None:
            return n if n <= budget else 0
        return min(n, chunk, budget)

    def _ensure_blocks(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``n`` more tokens of ``req``, preempting the newest others if needed."""
        bm = self.block_manager
        needed = bm.blocks_to_grow(req.request_id, req.num_computed_tokens + n)
        while needed > bm.num_free_blocks:
            victim = self.preempt_newest()
            assert victim is not None
            batch.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        if needed > 0:
            bm.append_blocks(req.request_id, needed)
        return True

    def _admit(self, req: Request, budget: int) -> int:
        """Allocate blocks for a waiting request's first chunk; 0 if it cannot start now."""
        bm = self.block_manager
        rid = req.request_id
        if bm.has_table(rid):
            # Its KV was imported (decode role): only the tokens after it remain to be fed.
            n = self._num_tokens_to_schedule(req, budget)
            needed = bm.blocks_to_grow(rid, req.num_computed_tokens + n)
            if n == 0 or needed > bm.num_free_blocks:
                return 0
            if needed > 0:
                bm.append_blocks(rid, needed)
            return n
        # Keep at least one token to compute: its logits give the next token.
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        if req.params.prompt_logprobs is not None:  # every position's logits are wanted
            max_hit_blocks = 0
        hashes = req.update_block_hashes(self.block_size)[:max_hit_blocks]
        hits = bm.match_prefix(hashes, req.all_token_ids)
        num_hit_tokens = len(hits) * self.block_size
        n = self._fit(req.num_tokens - num_hit_tokens, budget)
        needed = bm.blocks_needed(num_hit_tokens + n) - len(hits)
        if n == 0 or not bm.can_allocate(needed, hits):
            return 0
        bm.allocate(rid, needed, hits)
        req.num_computed_tokens = req.num_cached_tokens = num_hit_tokens
        return n

    def preempt_newest(self) -> Request | None:
        """Free the newest running request's blocks; it is recomputed from scratch later."""
        if not self.running:
            return None
        req = self.running.pop()
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    # -- in-flight prefix dedup ---------------------------------------------------------------

    def _uncomputed_full_blocks(self, req: Request) -> list[int]:
        """Hashes of the full blocks ``req`` has yet to compute (published as they finish)."""
        if not self.block_manager.enable_caching:
            return []
        hashes = req.update_block_hashes(self.block_size)
        return hashes[req.num_computed_tokens // self.block_size :]

    def _blocks_in_progress(self) -> set[int]:
        return {h for req in self.running for h in self._uncomputed_full_blocks(req)}

    def _needs_pending_block(self, req: Request, pending: set[int]) -> bool:
        """Whether the first block ``req`` would compute is one a running request computes."""
        if self.block_manager.has_table(req.request_id):
            return False  # its KV was imported: nothing of the prompt left to compute
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        if max_hit_blocks == 0:
            return False
        hashes = req.update_block_hashes(self.block_size)
        n = len(self.block_manager.match_prefix(hashes[:max_hit_blocks], req.all_token_ids))
        return n < max_hit_blocks and hashes[n] in pending

    # -- after the step -----------------------------------------------------------------------

    def commit(self, item: ScheduledRequest, num_rejected: int = 0) -> None:
        """Record that the step computed ``item``'s tokens but its ``num_rejected`` last drafts,
        and publish its full blocks (of known tokens: accepted drafts are published next step)."""
        req = item.request
        req.num_computed_tokens += item.num_new_tokens - num_rejected
        if req.num_computed_tokens >= self.block_size:
            hashes = req.update_block_hashes(self.block_size)
            self.block_manager.cache_blocks(
                req.request_id, hashes, req.all_token_ids, req.num_computed_tokens
            )
            self.handoff.computed(req)  # the role may stream them (prefill, long prompts)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues (it finished or left; its status says which queue)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req.status
            self.waiting.remove(req)

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting
