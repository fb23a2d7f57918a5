"""The engine: ``step()`` = schedule -> execute -> update. One per pool replica, any role.

The role is a collaborator, not a mode: ``LLMEngine(config, role=...)`` picks the hand-off
(``cluster.engine.handoff``) that decides where a new request goes, reserves blocks for KV that
arrives from outside, and holds a prefilled request's blocks for a pull: ``colocated`` (default),
requests are prefilled and decoded here; ``prefill``, a request's part ends with its first token,
whose output carries the block table held for the decode replica's pull (``release()`` frees it);
``decode``, a request added with ``prefill="auto" | "remote"`` may wait for KV in blocks it
reserves (``take_reservations()``), written from outside; ``kv_arrived()`` then hands in the
prefill replica's first tokens (the client has them already: they make no output here) and lets
it decode here. (Grammars: ``structured``.)

One request table: ``requests`` holds every live request, and a request's status names the
collaborator that holds it (the scheduler's queues, the hand-off awaiting KV, the sample groups:
``_holders``), so finishing, aborting and the integrity check look in one place.

Single-threaded: a server drives it from one dedicated step thread (``client.EngineClient``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from cluster.common.protocol import FirstToken
from cluster.common.sampling_params import SamplingParams, validate_prompt
from cluster.config import ClusterConfig
from cluster.engine import prompt_logprobs
from cluster.engine.block_manager import BlockManager
from cluster.engine.engine_stats import EngineCounters, engine_stats
from cluster.engine.handoff import (
    DecodeHandoff,
    KVReservation,
    MigrationExport,
    PrefillDecision,
    create_handoff,
)
from cluster.engine.outputs import EmittedTokens, OutputProcessor, RequestOutput
from cluster.engine.parallel import SampleGroups, check_n, sample_ids
from cluster.engine.request import EngineRequest, Request, RequestStatus, Resume
from cluster.engine.runner import ModelRunner, RunnerOutput
from cluster.engine.runner_registry import create_runner
from cluster.engine.scheduler import ScheduledBatch, Scheduler
from cluster.engine.spec import create_speculator
from cluster.engine.structured import StructuredOutput

__all__ = [
    "EngineCounters",
    "EngineRequest",
    "KVReservation",
    "LLMEngine",
    "MigrationExport",
    "PrefillDecision",
    "RequestOutput",
]

logger = logging.getLogger(__name__)


class RequestHolder(Protocol):
    """A collaborator that keeps live requests of some statuses (``LLMEngine._holders``)."""

    def remove(self, req: Request) -> None: ...
    def requests(self) -> Iterable[Request]: ...


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
        # The one request table: every live request by id; its status says who holds it.
        self.requests: dict[str, Request] = {}
        self._holders: dict[RequestStatus, RequestHolder] = {
            RequestStatus.WAITING: self.scheduler,
            RequestStatus.RUNNING: self.scheduler,
            RequestStatus.PREEMPTED: self.scheduler,
            RequestStatus.WAITING_FOR_KV: self.handoff,
            RequestStatus.WAITING_FOR_LEADER: self.samples,
            RequestStatus.MIGRATING: self.handoff,
        }
        self._pending_outputs: list[RequestOutput] = []
        self._reservations: list[KVReservation] = []
        self._seed_rng = random.Random(config.model.seed)
        self._preempt_every = config.testing.force_preempt_interval  # test mode only
        self.counters = EngineCounters()
        self.last_num_scheduled = 0  # items + reservations of the last step (idle detection)
        self.eos_token_ids: tuple[int, ...] = tuple(self.tokenizer.eos_token_ids)

    # -- intake -------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> PrefillDecision:
        """Validate and queue a request (``n`` samples: ``parallel``); ValueError names a field."""
        req = self._new_request(request)
        resumed = self._check_resume(request, req)
        decision = self.handoff.admit(req, request.prefill)
        if not decision.remote:
            self.scheduler.add(req)
        for r in (req, *self.samples.add(req, self.handoff.num_samples(req, request.n))):
            self.requests[r.request_id] = r
            self.outputs.add(r)
        if request.resume is not None:
            self._take_resumed(req, request.resume, resumed)
        self.counters.num_prompt_tokens += req.num_prompt_tokens
        if decision.remote:  # its blocks now, not after a step: the prefill call waits for them
            self._reservations.extend(self.scheduler.reserve_between_steps())
        return decision

    def _new_request(self, request: EngineRequest) -> Request:
        if not isinstance(request, EngineRequest):
            raise TypeError(f"add() takes an EngineRequest, got {type(request).__name__}")
        rid, params = request.request_id, request.params
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id: must be a non-empty string")
        for sid in sample_ids(rid, check_n(request.n)):
            if sid in self.requests or self.handoff.is_holding(sid):
                raise ValueError(f"request_id: {sid!r} already exists")
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        prompt = list(request.prompt_token_ids)
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
        seed = request.seed
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, prompt, params, seed, self.eos_token_ids)
        if request.arrival_time is not None:
            req.arrival_time = request.arrival_time
        return req

    def _check_resume(self, request: EngineRequest, req: Request) -> list[int]:
        """A migrated request's output tokens (``resume``), checked before any state changes:
        a single-sample request whose KV comes from outside, with tokens left to generate."""
        if request.resume is None:
            return []
        tokens = [int(t) for t in request.resume.token_ids]
        if not tokens:
            raise ValueError("resume.token_ids: a migrated request has output tokens")
        if request.prefill != "remote" or not isinstance(self.handoff, DecodeHandoff):
            raise ValueError("resume.token_ids: a migrated request needs the decode role, remote")
        if request.n != 1:
            raise ValueError("resume.token_ids: only a single-sample request migrates (n = 1)")
        if len(tokens) >= req.params.max_tokens:
            raise ValueError(
                f"resume.token_ids: {len(tokens)} tokens leave nothing of max_tokens "
                f"({req.params.max_tokens}) to generate"
            )
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise ValueError("resume.token_ids: a token id is outside the vocabulary")
        if request.resume.spec_track is not None:
            self.speculator.check_track(request.resume.spec_track)
        return tokens

    def _take_resumed(self, req: Request, resume: Resume, tokens: list[int]) -> None:
        """Replay a migrated request's outputs (the client has them): stop checks, detokenizer
        and grammar reach the state the source engine had; no output goes out."""
        em = EmittedTokens(list(tokens), [0.0] * len(tokens), [[] for _ in tokens])
        status, n = self.outputs.append_all(req, em)
        self.outputs.delta(req, em, n, status)  # its text is the one the client has
        if status is not None or req.output_token_ids != tokens:  # never expected: same code
            rid = req.request_id
            self.abort_request(rid)  # nobody listens yet: its final output goes nowhere
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id != rid]
            raise ValueError("resume.token_ids: the tokens end or change the request here")
        req.num_draft_tokens = max(0, int(resume.num_draft_tokens))
        req.num_accepted_tokens = min(req.num_draft_tokens, max(0, int(resume.num_accepted_tokens)))
        if resume.spec_track is not None:
            self.speculator.import_track(req.request_id, resume.spec_track)
        self.counters.num_migrated_in += 1

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

    def kv_arrived(self, request_id: str, first_tokens: Sequence[FirstToken]) -> list[str]:
        """The prefill replica's part of a remote request is done. ``first_tokens`` are its
        first tokens (sample 0's, then the samples' drawn with it: ``PrefillReply``), which the
        client already has: they are taken in without an output (a sample one of them ended
        is returned, it gets no output either). Unless sample 0's ended the request (there was
        no KV to pull then), its reserved blocks now hold the prompt's KV: it may decode.
        A migrated request (its outputs taken in at ``add``) has no first tokens to give."""
        handoff = self._decode_handoff()
        req = self._awaiting_kv(request_id)
        resumed = bool(req.output_token_ids) and not first_tokens
        ended = [] if resumed else self._take_first_tokens(request_id, first_tokens)
        if not req.is_finished:  # (a token that ended it there but not here failed it)
            self.scheduler.add(handoff.kv_arrived(request_id))
        return ended

    def kv_failed(
        self,
        request_id: str,
        recompute: bool,
        error: str = "",
        first_tokens: Sequence[FirstToken] = (),
    ) -> list[str]:
        """The prefill call or the pull failed: prefill locally (exact, thanks to seeded
        sampling), after taking in the first tokens the client already has, or fail. Returns
        the samples those tokens ended (they get no output)."""
        req = self.requests.get(request_id)
        if not recompute or req is None or req.status != RequestStatus.WAITING_FOR_KV:
            self.abort_request(request_id, error=error or "KV transfer failed")
            return []
        self._decode_handoff()
        ended = self._take_first_tokens(request_id, first_tokens) if first_tokens else []
        if not req.is_finished:
            self.handoff.remove(req)
            if self.block_manager.has_table(request_id):
                self.block_manager.free(request_id)
            req.num_computed_tokens = req.num_cached_tokens = 0
            self.scheduler.add(req)
        return ended

    def migrate_out(self, request_id: str) -> MigrationExport | None:
        """Pause a decoding request for live migration: off the running batch, its blocks kept
        (``MIGRATING``) until ``migration_ended``. None when it cannot move now (not decoding,
        several samples, prompt logprobs still owed, not here)."""
        handoff = self._decode_handoff()
        req = self.requests.get(request_id)
        if (
            req is None
            or req.status != RequestStatus.RUNNING
            or req.is_prefilling
            or req.num_uncomputed_tokens != 1
            or self.samples.samples(request_id) != [request_id]
        ):
            return None
        self.scheduler.remove(req)
        handoff.migrate(req)
        n = req.num_tokens - 1
        table = self.block_manager.block_table(request_id)[: self.block_manager.blocks_needed(n)]
        bs = self.block_manager.block_size
        hashes = req.update_block_hashes(bs)[: n // bs]
        return MigrationExport(
            request_id=request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            output_token_ids=tuple(req.output_token_ids),
            seed=req.seed,
            block_ids=tuple(table),
            block_hashes=tuple(hashes),
            num_kv_tokens=n,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            spec_track=self.speculator.export_track(request_id),
        )

    def migration_ended(self, request_id: str, moved: bool) -> bool:
        """A paused request's migration is over: ``moved`` (its KV was pulled, another replica
        decodes it) frees it here without an output; otherwise it decodes on here. False when
        it is not migrating (aborted meanwhile)."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.MIGRATING:
            return False
        self.handoff.remove(req)
        if moved:
            req.status = RequestStatus.FINISHED_ABORTED
            self.block_manager.free(request_id)
            self._forget(req)
            self.counters.num_migrated_out += 1
        else:
            self.scheduler.add(req)  # its table and KV are intact: it rejoins the batch
            self.counters.num_migrations_resumed += 1
        return True

    def _decode_handoff(self) -> DecodeHandoff:
        if not isinstance(self.handoff, DecodeHandoff):
            raise ValueError(f"this engine's role is {self.role}; KV import needs the decode role")
        return self.handoff

    def _awaiting_kv(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_KV:
            state = "unknown" if req is None else req.status.name
            raise ValueError(f"request {request_id!r}: not waiting for KV ({state})")
        return req

    def _take_first_tokens(self, request_id: str, tokens: Sequence[FirstToken]) -> list[str]:
        """Append each sample's first token from the prefill replica (checked first, all of
        them, so a bad one changes nothing); returns the ids of samples they ended."""
        if not tokens:
            raise ValueError(f"request {request_id!r}: no first token (sample 0's at least)")
        ids = sample_ids(request_id, len(tokens))
        reqs = [self.requests.get(sid) for sid in ids]
        for sid, req, tok in zip(ids, reqs, tokens, strict=True):
            if req is None or req.output_token_ids:
                raise ValueError(f"request {sid!r}: not in this engine, or has its first token")
            if not 0 <= tok.token_id < self.vocab_size:
                raise ValueError(f"first token id {tok.token_id} is outside the vocabulary")
        ended = []
        for req, tok in zip(reqs, tokens, strict=True):
            assert req is not None
            if self._take_first(req, tok):
                ended.append(req.request_id)
        return ended

    def _take_first(self, req: Request, tok: FirstToken) -> bool:
        """One sample's first token, streamed by the caller: this engine's stop checks,
        detokenizer and grammar advance as they would have, but no output goes out. True when
        it ended the sample as the prefill replica's did."""
        top = list(tok.top_logprobs) if tok.top_logprobs is not None else None
        em = EmittedTokens([tok.token_id], [tok.logprob], [top])
        status, n = self.outputs.append_all(req, em)
        self.counters.num_generated_tokens += n
        self.counters.num_cached_prompt_tokens += req.num_cached_tokens
        out = self.outputs.delta(req, em, n, status)  # its text is the one the client has
        if status is not None:
            self._finish(req, status)
        if (status is None) == (tok.finish_reason is None):
            return status is not None
        # Never expected (both engines run the same code on the same token): the end here
        # goes out with what text the client lacks; an end only there fails the sample.
        logger.error(
            "request %s: the decode engine's first token %r (%r, %s) differs from the prefill "
            "replica's (%r, %s)",
            req.request_id,
            tok.token_id,
            out.new_text,
            out.finish_reason,
            tok.text,
            tok.finish_reason,
        )
        if status is None:
            self._abort(req, "the prefill and decode engines disagree on the first token")
            return False
        extra = out.new_text[len(tok.text) :] if out.new_text.startswith(tok.text) else ""
        self._pending_outputs.append(
            dataclasses.replace(
                out, new_token_ids=[], new_text=extra, new_logprobs=None, new_top_logprobs=None
            )
        )
        return False

    # -- prefill role -------------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Free a prefilled request's held blocks (pulled, expired or cancelled); a streamed
        prompt still prefilling when its lease ended is aborted too."""
        if request_id in self.requests:
            self.abort_request(request_id)
        return self.handoff.release(request_id)

    # -- the step -----------------------------------------------------------------------------

    def runner_problem(self) -> str | None:
        """Why the runner cannot run a step (a tensor-parallel rank died), or None."""
        problem = getattr(self.runner, "problem", None)
        return problem() if problem is not None else None

    def close(self) -> None:
        """Let go of what the runner holds outside this process (a tensor-parallel engine's
        other ranks)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

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
            self._holders[req.status].remove(req)  # (a sample's first token: nothing held)
            self._forget(req)
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self._holders[req.status].remove(req)
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
        """Blocks (free + cached + used == total); the request table: every live request is
        held by the collaborator its status names and by no other, nothing else is held; no
        grammar matcher outlives its request."""
        self.block_manager.check_integrity()
        held = [(r, h) for h in dict.fromkeys(self._holders.values()) for r in h.requests()]
        wrong = {
            r.request_id
            for r, h in held
            if self.requests.get(r.request_id) is not r or self._holders.get(r.status) is not h
        }
        wrong.update(set(self.requests) - {r.request_id for r, _ in held})
        if wrong or len(held) != len(self.requests):
            raise AssertionError(
                f"the request table and its holders disagree on: {sorted(wrong)[:5]} "
                f"({len(held)} held, {len(self.requests)} live)"
            )
        stray = self.structured.active_ids() - set(self.requests)
        if stray:
            raise AssertionError(f"grammar matchers of requests not live: {sorted(stray)[:5]}")

    def stats(self) -> dict[str, Any]:
        stats = engine_stats(
            self.counters,
            self.scheduler,
            self.handoff,
            self.samples,
            self.block_manager,
            self.speculator,
            self.structured,
        )
        load = getattr(getattr(self.runner, "model", None), "expert_load", None)
        if load is not None:  # a mixture-of-experts model: the router's load balance
            stats["moe"] = load.stats()
        return stats
