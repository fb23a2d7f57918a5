"""The engine: ``step()`` = schedule -> execute -> update. One per pool replica, any role.

The role is a collaborator, not a mode: ``LLMEngine(config, role=...)`` picks the hand-off
(``cluster.engine.handoff``) that decides where a new request goes, reserves blocks for KV that
arrives from outside, and holds a prefilled request's blocks for a pull: ``colocated`` (default),
requests are prefilled and decoded here; ``prefill``, a request's part ends with its first token,
whose output carries the block table held for the decode replica's pull (``release()`` frees it);
``decode``, ``add(..., prefill="auto" | "remote")`` may keep a request waiting for KV in blocks it
reserves (``take_reservations()``), written from outside; ``accept_first_token()`` streams the
prefill replica's first token, ``kv_arrived()`` lets it decode here. (Grammars: ``structured``.)

Single-threaded: a server drives it from one dedicated step thread (``client.EngineClient``).
"""

from __future__ import annotations

import random
import time
from typing import Any

from cluster.common.sampling_params import SamplingParams, validate_prompt
from cluster.config import ClusterConfig
from cluster.engine import prompt_logprobs
from cluster.engine.block_manager import BlockManager
from cluster.engine.engine_stats import EngineCounters, engine_stats
from cluster.engine.handoff import (
    Admission,
    DecodeHandoff,
    KVReservation,
    PrefillMode,
    create_handoff,
)
from cluster.engine.outputs import EmittedTokens, OutputProcessor, RequestOutput
from cluster.engine.parallel import SampleGroups, check_n, sample_ids
from cluster.engine.request import Request, RequestStatus
from cluster.engine.runner import ModelRunner, RunnerOutput
from cluster.engine.runner_registry import create_runner
from cluster.engine.scheduler import ScheduledBatch, Scheduler
from cluster.engine.spec import create_speculator
from cluster.engine.structured import StructuredOutput

__all__ = ["Admission", "EngineCounters", "KVReservation", "LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(
        self, config: ClusterConfig, runner: ModelRunner | None = None, *, role: str = "colocated"
    ) -> None:
        self.config = config
        self.role = role
        self.runner = runner if runner is not None else create_runner(config)
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.handoff = create_handoff(role, config, self.block_manager)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.handoff)
        self.speculator = create_speculator(config.decode.speculative)
        self.samples = SampleGroups(self.block_manager)  # n > 1: samples on shared blocks
        self.structured = StructuredOutput(
            config, self.tokenizer, self.vocab_size, self.max_model_len
        )
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.structured)
        self.requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._reservations: list[KVReservation] = []
        self._seed_rng = random.Random(config.model.seed)
        self._preempt_every = config.testing.force_preempt_interval  # test mode only
        self.counters = EngineCounters()
        self.last_num_scheduled = 0  # items + reservations of the last step (idle detection)
        self.eos_token_ids: tuple[int, ...] = tuple(self.tokenizer.eos_token_ids)

    # -- intake -------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill: PrefillMode = "local",
        seed: int | None = None,
        arrival_time: float | None = None,
        n: int = 1,
    ) -> Admission:
        """Validate and queue a request (``n`` samples: ``parallel``); ValueError names a field."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        for rid in sample_ids(request_id, check_n(n)):
            if rid in self.requests or self.handoff.is_holding(rid):
                raise ValueError(f"request_id: {rid!r} already exists")
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        prompt = list(prompt_token_ids)
        validate_prompt(
            prompt, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self.structured.check(params)  # compiles (and caches) a JSON schema's grammar
        needed = self.block_manager.blocks_needed(len(prompt) + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens need {needed} KV blocks but the pool has "
                f"{self.block_manager.num_blocks}"
            )
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(request_id, prompt, params, seed, self.eos_token_ids)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        admission = self.handoff.admit(req, prefill)
        if not admission.remote:
            self.scheduler.add(req)
        for r in (req, *self.samples.add(req, self.handoff.num_samples(req, n))):
            self.requests[r.request_id] = r
            self.outputs.add(r)
        self.counters.num_prompt_tokens += len(prompt)
        if admission.remote:  # its blocks now, not after a step: the prefill call waits for them
            self._reservations.extend(self.scheduler.reserve_between_steps())
        return admission

    def abort_request(self, request_id: str, error: str | None = None) -> bool:
        """End a request, all its samples, wherever they are (queued, running, awaiting KV, held);
        frees their blocks (a streamed prompt's pins: ``release``, a lease may be reading them)."""
        live = [self.requests[r] for r in self.samples.samples(request_id) if r in self.requests]
        if not live:
            return self.handoff.release(request_id)  # held for a pull, or unknown
        for req in live:
            self._abort(req, error)
        return True

    def _abort(self, req: Request, error: str | None) -> None:
        req.error = error
        self._finish(req, RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED)
        self.counters.num_aborted += 1
        self._pending_outputs.append(self.outputs.final(req))

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
        """The prefill replica's first token (the server already streamed it), before the KV."""
        req = self.requests[request_id]
        if req.output_token_ids:
            raise ValueError(f"request {request_id!r} already has its first token")
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"first token id {token_id} is outside the vocabulary")
        return self._append(req, EmittedTokens([token_id], [logprob], [top_logprobs]))

    def kv_arrived(self, request_id: str) -> None:
        """All reserved blocks hold the prompt's KV: the request may join the decode batch."""
        if not self.requests[request_id].output_token_ids:
            raise ValueError(f"request {request_id!r}: KV arrived before its first token")
        self.scheduler.add(self._decode_handoff().kv_arrived(request_id))

    def kv_failed(self, request_id: str, recompute: bool, error: str = "") -> None:
        """The transfer failed: prefill locally (exact, thanks to seeded sampling) or fail."""
        req = self.requests.get(request_id)
        if not recompute or req is None or req.status != RequestStatus.WAITING_FOR_KV:
            self.abort_request(request_id, error=error or "KV transfer failed")
            return
        self._decode_handoff().take(request_id)
        if self.block_manager.has_table(request_id):
            self.block_manager.free(request_id)
        req.num_computed_tokens = req.num_cached_tokens = 0
        self.scheduler.add(req)

    def _decode_handoff(self) -> DecodeHandoff:
        if not isinstance(self.handoff, DecodeHandoff):
            raise ValueError(f"this engine's role is {self.role}; KV import needs the decode role")
        return self.handoff

    # -- prefill role -------------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Free a prefilled request's held blocks (pulled, expired or cancelled); a streamed
        prompt still prefilling when its lease ended is aborted too."""
        if request_id in self.requests:
            self.abort_request(request_id)
        return self.handoff.release(request_id)

    # -- the step -----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.schedule()
        result = self._execute(batch)
        outputs = self.update(batch, result)
        if result is not None:
            self.counters.step_times.append(time.perf_counter() - t0)
            del self.counters.step_times[:-2048]
        return outputs

    def _execute(self, batch: ScheduledBatch) -> RunnerOutput | None:  # timed: draft row cost
        t0, result = time.perf_counter(), self.runner.execute(batch) if batch.items else None
        self.speculator.observe_step(batch.items, time.perf_counter() - t0)
        return result

    def schedule(self) -> ScheduledBatch:
        if self._preempt_every and (self.counters.num_steps + 1) % self._preempt_every == 0:
            self.scheduler.preempt_newest()  # testing.force_preempt_interval: churn on purpose
        for sample in self.samples.release(self.requests):  # their leader's prompt KV is here
            self.scheduler.add(sample)
        drafts = self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule(self.structured.drafts(self.scheduler.running, drafts))
        batch.masks = self.structured.masks(batch.items)
        self.samples.fan_out(batch.items)  # samples drawing their first token with the leader
        self._reservations.extend(batch.reservations)
        self.last_num_scheduled = len(batch.items) + len(batch.reservations)
        return batch

    def update(self, batch: ScheduledBatch, result: RunnerOutput | None) -> list[RequestOutput]:
        """Record what the step computed and sampled; returns this step's outputs."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if result is None:
            return outputs
        emitted = result.per_request()
        prompt_logprobs.record(self.requests, result.prompt_logprobs)  # before the outputs
        for item in batch.items:
            # Drafts up to the first mismatch were accepted: their positions' KV is verified;
            # the rest is rolled back (not computed; the slots are overwritten later).
            em = emitted.get(item.request.request_id)
            num_accepted = len(em.token_ids) - 1 if em is not None else 0
            self.speculator.record(item, num_accepted)
            self.scheduler.commit(item, num_rejected=len(item.draft_token_ids) - num_accepted)
        outputs.extend(self.handoff.take_outputs())  # streamed blocks (prefill role)
        for rid, em in emitted.items():
            outputs.append(self._append(self.requests[rid], em))
        self.counters.num_steps += 1
        return outputs

    def _append(self, req: Request, em: EmittedTokens) -> RequestOutput:
        """A step's tokens for ``req``, appended one by one until one of them ends it."""
        status, n = self.outputs.append_all(req, em)
        self.counters.num_generated_tokens += n
        if req.num_output_tokens == n:  # its first tokens
            self.counters.num_cached_prompt_tokens += req.num_cached_tokens
        held = self.handoff.hold(req) if status is None and self.handoff.ends_here(req) else None
        out = self.outputs.delta(req, em, n, status, held)
        if status is not None:
            self._finish(req, status)
        elif held is not None:  # this engine's part is over; the blocks wait for a pull
            if not self.scheduler.remove(req):
                self.samples.take(req)  # a sample's first token (prefill role): nothing held
            self._forget(req)
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if not self.scheduler.remove(req) and not self.samples.take(req):
            self.handoff.take(req.request_id)
        req.status = status
        if self.block_manager.has_table(req.request_id):
            self.block_manager.free(req.request_id)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.outputs.forget(req.request_id)
        self.speculator.forget(req.request_id)
        self.samples.forget(req.request_id)
        self.counters.num_finished += 1

    # -- introspection ------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        tracked = {r.request_id for r in self.scheduler.all_requests()}
        tracked.update(r.request_id for r in (*self.handoff.requests(), *self.samples.requests()))
        live = set(self.requests)
        if tracked != live or not self.structured.active_ids() <= live:
            diff = sorted(tracked ^ live or self.structured.active_ids() - live)[:5]
            raise AssertionError(f"engine, scheduler, matchers disagree on live requests: {diff}")

    def stats(self) -> dict[str, Any]:
        return engine_stats(
            self.counters,
            self.scheduler,
            self.handoff,
            self.samples,
            self.block_manager,
            self.speculator,
            self.structured,
        )
