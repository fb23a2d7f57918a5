"""From sampled tokens to what a caller sees: stop conditions, text deltas, ``RequestOutput``.

``OutputProcessor`` keeps each live request's incremental detokenizer (only where text is
wanted: a prefill-role engine streams no text) and decides, per appended token (a step that
accepted drafts appends several, one by one), whether the request stopped: a stop or EOS token
(after ``min_tokens``), a stop string in the text, the length limit (``max_tokens``, the
model's context), or a structured-output grammar complete (``structured``: its matcher advances
over every appended token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from cluster.common.tokenizer import Tokenizer
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.request import Request, RequestStatus


@dataclass(slots=True)
class EmittedTokens:
    """One request's tokens of a step (with drafts, possibly several)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


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
    index: int = 0  # which of the request's n samples (``parallel``); request_id is its own
    num_draft_tokens: int = 0  # speculative drafts verified for the request so far
    num_accepted_tokens: int = 0  # ... of which were accepted
    error: str | None = None
    # params.prompt_logprobs, on sample 0's first output: None for the first prompt token, then
    # each next one's (logprob, top k) (``prompt_logprobs``)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # Prefill role: the request's part here ended with this output and these blocks (its whole
    # table, prompt order) are held for a decode replica's pull; finish_reason is then None.
    held_block_ids: list[int] | None = None
    # Prefill role, a streamed prompt: no token yet, but these blocks (prompt order, full and
    # computed) are held so far: the whole list published to date, a prefix of the final table.
    streamed_block_ids: list[int] | None = None
    # Monotonic timestamps (this process's clock): arrival, first scheduled, first token.
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None


def _logprob_of(token_id: int, top: list[tuple[int, float]] | None) -> float:
    """A token the model did not sample: its logprob among the step's top ones, else -9999.0
    (OpenAI's floor for a negligible probability)."""
    return next((lp for t, lp in top or [] if t == token_id), -9999.0)


class GrammarTracker(Protocol):
    """Structured output's per-request matchers (``structured.StructuredOutput``)."""

    def add(self, req: Request) -> None: ...
    def forget(self, request_id: str) -> None: ...
    def choose(self, req: Request, token_id: int) -> int: ...
    def advance(
        self, req: Request, token_id: int, status: RequestStatus | None
    ) -> RequestStatus | None: ...


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int, structured: GrammarTracker
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.structured = structured
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        """Track a new request (every role detokenizes: a prefill replica's first token goes
        to the client with its text, straight from the decode replica, before that engine
        takes it)."""
        self.structured.add(req)
        p = req.params
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            p.stop,
            p.skip_special_tokens,
            req.prompt_token_ids,
            p.include_stop_str_in_output,
        )

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self.structured.forget(request_id)

    def append(
        self,
        req: Request,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
    ) -> RequestStatus | None:
        """Append a sampled token to ``req``; returns its finished status if it stopped."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token_id)
        if logprob is not None and p.logprobs is not None:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top or [])
        may_stop = req.num_output_tokens >= p.min_tokens
        if may_stop and (
            token_id in p.stop_token_ids or (not p.ignore_eos and token_id in req.eos_token_ids)
        ):
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        detok = self._detok.get(req.request_id)
        matched = detok.add(token_id) if detok is not None else None
        if matched is not None and may_stop:
            req.stop_reason = matched
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def append_all(self, req: Request, em: EmittedTokens) -> tuple[RequestStatus | None, int]:
        """Append a step's tokens one by one (each checked for stops) until one ends ``req``;
        returns its finished status (None: it goes on) and how many were appended."""
        for i, sampled in enumerate(em.token_ids):
            token_id = self.structured.choose(req, sampled)  # the grammar's, to close in budget
            if token_id != sampled:  # only ever the step's last token (its KV is not computed)
                em.token_ids[i] = token_id
                if em.logprobs[i] is not None:
                    em.logprobs[i] = _logprob_of(token_id, em.top_logprobs[i])
            status = self.append(req, token_id, em.logprobs[i], em.top_logprobs[i])
            status = self.structured.advance(req, token_id, status)
            if status is not None:
                return status, i + 1
        return None, len(em.token_ids)

    def delta(
        self,
        req: Request,
        em: EmittedTokens,
        num_appended: int,
        status: RequestStatus | None,
        held_block_ids: list[int] | None = None,
    ) -> RequestOutput:
        """The output of a step's first ``num_appended`` tokens of ``em``; ``status``: the
        request finished with the last of them."""
        with_logprobs = em.logprobs[0] is not None and req.params.logprobs is not None
        finished = status is not None or held_block_ids is not None
        # A held output (prefill role) ends only this engine's part: its text is held back as
        # a running request's is, so it equals what the decode engine computes for that token.
        out = self._output(
            req, em.token_ids[:num_appended], finished, status, flush=status is not None
        )
        if with_logprobs:
            out.new_logprobs = [lp or 0.0 for lp in em.logprobs[:num_appended]]
            out.new_top_logprobs = [top or [] for top in em.top_logprobs[:num_appended]]
        out.held_block_ids = held_block_ids
        if req.params.prompt_logprobs is not None and req.num_output_tokens == num_appended:
            out.prompt_logprobs = [None, *req.prompt_logprobs] if not req.sample_index else None
        return out

    def final(self, req: Request) -> RequestOutput:
        """The last output of a request ended from outside (aborted, failed)."""
        out = self._output(req, [], True, req.status)
        out.error = req.error
        return out

    def _output(
        self,
        req: Request,
        token_ids: list[int],
        finished: bool,
        status: RequestStatus | None,
        flush: bool = True,
    ) -> RequestOutput:
        """``flush``: hand out held-back text too (the request ended)."""
        detok = self._detok.get(req.request_id)
        reason = status.finish_reason if status is not None else None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=token_ids,
            new_text=detok.delta(flush) if detok is not None else "",
            finished=finished,
            finish_reason=reason.value if reason is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            index=req.sample_index,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            arrival_time=req.arrival_time,
            scheduled_time=req.scheduled_time,
            first_token_time=req.first_token_time,
        )
