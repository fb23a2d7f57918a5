"""The engine: ``step()`` = schedule -> execute -> update. One per pool replica, any role.

Roles are not modes of this class but ways of adding requests:
  * ``add_request(...)``: a normal request, prefilled and decoded here;
  * ``add_request(..., prefill_only=True)`` (prefill role): stops after its first token and keeps
    its blocks until ``release()`` (the KV is pulled by a decode replica under a lease);
  * ``add_request(..., kv_pending=True)`` (decode role): blocks are reserved (reported by
    ``take_reservations()``), the KV is written into them from outside, the first token is
    handed in with ``accept_first_token()``, and ``kv_arrived()`` lets decoding start.

Single-threaded: a server drives it from one dedicated step thread.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.common.sampling_params import SamplingParams, validate_prompt
from cluster.common.tokenizer import IncrementalDetokenizer
from cluster.config import ClusterConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.model_runner import ModelRunner, create_runner
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import KVReservation, Scheduler


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), or its final state."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # Monotonic timestamps (this process's clock): arrival, first scheduled, first token.
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass(slots=True)
class EngineCounters:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    step_times: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: ClusterConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner if runner is not None else create_runner(config)
        self.tokenizer = self.runner.tokenizer
        self.block_size = config.cache.block_size
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, config.testing.force_preempt_interval
        )
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._reservations: list[KVReservation] = []
        self._seed_rng = random.Random(config.model.seed)
        self.counters = EngineCounters()
        self.last_num_scheduled = 0  # items + reservations of the last step (idle detection)
        self.eos_token_ids: tuple[int, ...] = tuple(self.tokenizer.eos_token_ids)

    # -- intake -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        kv_pending: bool = False,
        seed: int | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request; raises ``ValueError`` naming the bad field."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.requests or request_id in self.scheduler.held:
            raise ValueError(f"request_id: {request_id!r} already exists")
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        prompt = list(prompt_token_ids)
        validate_prompt(
            prompt, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        needed = self.block_manager.blocks_needed(len(prompt) + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens need {needed} KV blocks but the pool has "
                f"{self.block_manager.num_blocks}"
            )
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            prefill_only=prefill_only,
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[request_id] = req
        if not prefill_only:
            self._detok[request_id] = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.skip_special_tokens, prompt
            )
        if kv_pending:
            self.scheduler.add_kv_pending(req)
        else:
            self.scheduler.add(req)
        self.counters.num_prompt_tokens += len(prompt)
        return req

    def abort_request(self, request_id: str, error: str | None = None) -> bool:
        """End a request wherever it is (queued, running, awaiting KV, held); frees its blocks."""
        if self.scheduler.release_held(request_id):
            return True
        req = self.requests.get(request_id)
        if req is None:
            return False
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        req.error = error
        self._finish(req, status)
        self.counters.num_aborted += 1
        self._pending_outputs.append(self._final_output(req))
        return True

    # -- decode role --------------------------------------------------------------------------

    def take_reservations(self) -> list[KVReservation]:
        """Block reservations made since the last call (the KV to pull goes into these)."""
        out, self._reservations = self._reservations, []
        return out

    def accept_first_token(
        self,
        request_id: str,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> RequestOutput:
        """The prefill replica's first token: stream it now, before the KV has arrived."""
        req = self.requests[request_id]
        if req.output_token_ids:
            raise ValueError(f"request {request_id!r} already has its first token")
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"first token id {token_id} is outside the vocabulary")
        return self._append_token(req, token_id, logprob, top_logprobs)

    def kv_arrived(self, request_id: str) -> None:
        """All reserved blocks hold the prompt's KV: the request may join the decode batch."""
        req = self.requests[request_id]
        if not req.output_token_ids:
            raise ValueError(f"request {request_id!r}: KV arrived before its first token")
        self.scheduler.kv_arrived(request_id)

    def kv_failed(self, request_id: str, recompute: bool, error: str = "") -> None:
        """The transfer failed: prefill locally (exact, thanks to seeded sampling) or fail."""
        req = self.requests.get(request_id)
        if recompute and req is not None and req.status == RequestStatus.WAITING_FOR_KV:
            self.scheduler.kv_failed_recompute(request_id)
        else:
            self.abort_request(request_id, error=error or "KV transfer failed")

    # -- prefill role -------------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Free a prefill-only request's held blocks (pulled, expired or cancelled)."""
        return self.scheduler.release_held(request_id)

    def held_block_ids(self, request_id: str) -> list[int]:
        if request_id not in self.scheduler.held:
            raise KeyError(request_id)
        return self.block_manager.block_table(request_id)

    # -- the step -----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        self._reservations.extend(batch.reservations)
        self.last_num_scheduled = len(batch.items) + len(batch.reservations)
        if batch.is_empty:
            return outputs
        result = self.runner.execute(batch)
        for item in batch.items:
            self.scheduler.commit(item)
        for i, rid in enumerate(result.request_ids):
            req = self.requests[rid]
            lp = result.logprobs[i] if result.logprobs is not None else None
            top = result.top_logprobs[i] if result.top_logprobs is not None else None
            outputs.append(self._append_token(req, result.token_ids[i], lp, top))
        self.counters.num_steps += 1
        self.counters.step_times.append(time.perf_counter() - t0)
        if len(self.counters.step_times) > 4096:
            del self.counters.step_times[:2048]
        return outputs

    def _append_token(
        self,
        req: Request,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
    ) -> RequestOutput:
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token_id)
        if logprob is not None and p.logprobs is not None:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top or [])
        self.counters.num_generated_tokens += 1
        if req.num_output_tokens == 1:
            self.counters.num_cached_prompt_tokens += req.num_cached_tokens
        status: RequestStatus | None = None
        if req.num_output_tokens >= p.min_tokens:
            if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in req.eos_token_ids):
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        detok = self._detok.get(req.request_id)
        if status is None and detok is not None:
            matched = detok.add(token_id)
            if matched is not None and req.num_output_tokens >= p.min_tokens:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, matched
        if status is None and (
            req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is None and req.prefill_only:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)
        finished = status is not None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token_id],
            new_text=detok.delta(finished) if detok is not None else "",
            finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            new_logprobs=[logprob] if (logprob is not None and p.logprobs is not None) else None,
            new_top_logprobs=[top or []]
            if (logprob is not None and p.logprobs is not None)
            else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            scheduled_time=req.scheduled_time,
            first_token_time=req.first_token_time,
        )

    def _finish(self, req: Request, status: RequestStatus) -> None:
        hold = req.prefill_only and status == RequestStatus.FINISHED_LENGTH
        self.scheduler.finish(req, status, hold_blocks=hold)
        del self.requests[req.request_id]
        self._detok.pop(req.request_id, None)
        self.counters.num_finished += 1

    def _final_output(self, req: Request) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            new_text=detok.delta(True) if detok is not None else "",
            finished=True,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            arrival_time=req.arrival_time,
            scheduled_time=req.scheduled_time,
            first_token_time=req.first_token_time,
        )

    # -- introspection ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        tracked = {r.request_id for r in self.scheduler.all_requests()}
        if tracked != set(self.requests):
            raise AssertionError(
                f"engine and scheduler disagree on live requests: "
                f"{sorted(tracked ^ set(self.requests))[:5]}"
            )

    def _queued_prefill_tokens(self) -> int:
        """Prompt tokens not computed yet, over the waiting and running requests (autoscaling)."""
        sched = self.scheduler
        return sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for queue in (sched.waiting, sched.running)
            for r in queue
        )

    def stats(self) -> dict[str, Any]:
        c = self.counters
        bm = self.block_manager.stats()
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_for_kv": len(self.scheduler.kv_waiting) + len(self.scheduler.kv_reserved),
            "num_held": len(self.scheduler.held),
            "num_queued_prefill_tokens": self._queued_prefill_tokens(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": c.num_steps,
            "num_prompt_tokens": c.num_prompt_tokens,
            "num_cached_prompt_tokens": c.num_cached_prompt_tokens,
            "num_generated_tokens": c.num_generated_tokens,
            "num_finished": c.num_finished,
            "num_aborted": c.num_aborted,
            "prefix_cache_hit_rate": (
                c.num_cached_prompt_tokens / c.num_prompt_tokens if c.num_prompt_tokens else 0.0
            ),
            "kv": bm,
        }
