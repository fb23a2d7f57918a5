"""Admission control at a router replica: a fast RESOURCE_EXHAUSTED / 429 instead of a queue.

Two tests, both before any pool work:

  * places: at most ``limit`` samples are in flight here at once
    (``serving.options.router_admission_limit``: what the decode pool can hold; a request with n
    samples counts n). ``check`` is the cheap test each API runs first, before reading or
    parsing anything, so an overloaded router refuses in microseconds.
  * the TTFT SLO (``router.ttft_slo_ms``; 0: off): ``admitted``, once the request is parsed (its
    prompt length known), asks the router's ``TtftModel`` what the request's TTFT would be behind
    the prompts admitted here that have no first token yet, and refuses it when that p99
    estimate is over the SLO, unless nothing is waiting (alone, a request is as fast as it
    gets). So what is admitted can start within the SLO, and the rest is told at once.

``admitted`` holds the places for the request's whole stream (the one check that counts, under
the race) and yields a ``Ticket``; ``first_token(ticket)`` reports the first token (the model
learns from it and the prompt leaves the queue).

Every refusal carries a retry delay (HTTP ``Retry-After``, gRPC ``grpc-retry-pushback-ms``) read
off the queue: for places, a place frees every ``mean duration / limit`` seconds on average and
the requests refused since one last freed are ahead of this one; for the SLO, the queue must
drain by the predicted excess. So a burst's clients spread their retries instead of coming back
together, and none is told to wait longer than ``MAX_RETRY_AFTER_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cluster.common.errors import ErrorCode, PDServeError
from cluster.router.ttft_model import TtftModel

MIN_RETRY_AFTER_S = 0.05
MAX_RETRY_AFTER_S = 30.0
_PRIOR_DURATION_S = 1.0  # a request's time in flight before any finished here
_DECAY = 0.9  # weight of the older durations in the mean


@dataclass(slots=True)
class Ticket:
    """An admitted request: its own prompt and samples, and what was waiting when it came."""

    prompt_tokens: int
    weight: int  # samples
    tokens: int  # prompt tokens without a first token, its own included
    requests: int  # samples without a first token, its own included
    start: float
    waiting: bool = True  # no first token yet


class Admission:
    def __init__(
        self,
        limit: int,
        clock: Callable[[], float] = time.monotonic,
        ttft_slo_s: float = 0.0,
        model: TtftModel | None = None,
    ) -> None:
        self.limit = limit
        self.ttft_slo_s = ttft_slo_s
        self.model = model or TtftModel()
        self.num_inflight = 0  # samples (a request with n samples holds n places)
        self.num_rejected = 0
        self.num_rejected_slo = 0  # of which refused by the TTFT SLO
        self.mean_duration_s = _PRIOR_DURATION_S
        self._clock = clock
        self._refused_since_free = 0
        self.waiting_tokens = 0  # of the admitted requests without a first token
        self.waiting_requests = 0

    def retry_after_s(self) -> float:
        """When a client refused for want of a place should come back: the time until enough
        places free for it and for those refused before it (since a place last freed)."""
        per_place = self.mean_duration_s / max(1, self.limit)
        return _bounded(per_place * (1 + self._refused_since_free))

    def _refuse(self, request_id: str, message: str, delay: float) -> PDServeError:
        self.num_rejected += 1
        self._refused_since_free += 1
        return PDServeError(ErrorCode.RESOURCE_EXHAUSTED, message, request_id, retry_after_s=delay)

    def check(
        self, request_id: str = "", weight: int = 1, prompt_tokens: int | None = None
    ) -> None:
        """Refuse (RESOURCE_EXHAUSTED) what would not be admitted now: for want of a place
        and, once the prompt's length is known, by the TTFT SLO."""
        # A request wider than the whole limit still runs alone, never starves.
        if self.num_inflight and self.num_inflight + weight > self.limit:
            delay = self.retry_after_s()
            raise self._refuse(request_id, "the cluster is at capacity; retry", delay)
        if prompt_tokens is not None:
            self._check_slo(request_id, prompt_tokens, weight)

    def predicted_ttft_s(self, prompt_tokens: int, weight: int = 1) -> float | None:
        """The model's p99 TTFT for a request arriving now (None: not enough seen yet)."""
        return self.model.predict(
            self.waiting_tokens + prompt_tokens, self.waiting_requests + weight
        )

    def _check_slo(self, request_id: str, prompt_tokens: int, weight: int) -> None:
        if self.ttft_slo_s <= 0 or not self.waiting_requests:
            return
        predicted = self.predicted_ttft_s(prompt_tokens, weight)
        if predicted is None or predicted <= self.ttft_slo_s:
            return
        self.num_rejected_slo += 1
        raise self._refuse(
            request_id,
            f"the cluster cannot start this request within its TTFT SLO "
            f"(router.ttft_slo_ms={self.ttft_slo_s * 1000:.0f}; predicted "
            f"{predicted * 1000:.0f} ms); retry",
            _bounded(predicted - self.ttft_slo_s),
        )

    @contextmanager
    def admitted(
        self, request_id: str, weight: int = 1, prompt_tokens: int = 0
    ) -> Iterator[Ticket]:
        self.check(request_id, weight, prompt_tokens)
        ticket = Ticket(
            prompt_tokens,
            weight,
            self.waiting_tokens + prompt_tokens,
            self.waiting_requests + weight,
            self._clock(),
        )
        self.waiting_tokens += prompt_tokens
        self.waiting_requests += weight
        self.num_inflight += weight
        try:
            yield ticket
        finally:
            self._leave_queue(ticket)
            self.num_inflight -= weight
            took = self._clock() - ticket.start
            self.mean_duration_s = _DECAY * self.mean_duration_s + (1 - _DECAY) * took
            self._refused_since_free = 0

    def first_token(self, ticket: Ticket) -> None:
        """The request's first token reached the router: the model learns its TTFT, and its
        prompt leaves the queue the next requests wait behind."""
        if ticket.waiting:
            self._leave_queue(ticket)
            self.model.observe(ticket.tokens, ticket.requests, self._clock() - ticket.start)

    def _leave_queue(self, ticket: Ticket) -> None:
        if not ticket.waiting:
            return
        ticket.waiting = False
        self.waiting_tokens -= ticket.prompt_tokens
        self.waiting_requests -= ticket.weight


def _bounded(delay: float) -> float:
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, delay))
