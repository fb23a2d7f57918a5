"""Admission control at a router replica: a fast RESOURCE_EXHAUSTED / 429 instead of a queue.

At most ``limit`` samples are in flight here at once (``serving.options.router_admission_limit``:
what the decode pool can hold; a request with n samples counts n). ``check`` is the cheap test
each API runs first, before reading or parsing anything, so an overloaded router refuses in
microseconds; ``admitted`` holds the places for the request's whole stream (the one check that
counts, under the race).

Every refusal carries a retry delay (HTTP ``Retry-After``, gRPC ``retry-after-ms``) read off the
queue: a place frees every ``mean duration / limit`` seconds on average, and the requests refused
since one last freed are ahead of this one. So a burst's clients spread their retries instead of
coming back together, and none is told to wait longer than ``MAX_RETRY_AFTER_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cluster.common.errors import ErrorCode, PDServeError

MIN_RETRY_AFTER_S = 0.05
MAX_RETRY_AFTER_S = 30.0
_PRIOR_DURATION_S = 1.0  # a request's time in flight before any finished here
_DECAY = 0.9  # weight of the older durations in the mean


class Admission:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.num_inflight = 0  # samples (a request with n samples holds n places)
        self.num_rejected = 0
        self.mean_duration_s = _PRIOR_DURATION_S
        self._clock = clock
        self._refused_since_free = 0

    def retry_after_s(self) -> float:
        """When a refused client should come back: the time until enough places free for it
        and for those refused before it (since a place last freed)."""
        per_place = self.mean_duration_s / max(1, self.limit)
        wait = per_place * (1 + self._refused_since_free)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait))

    def _refuse(self, request_id: str, message: str) -> PDServeError:
        delay = self.retry_after_s()
        self.num_rejected += 1
        self._refused_since_free += 1
        return PDServeError(ErrorCode.RESOURCE_EXHAUSTED, message, request_id, retry_after_s=delay)

    def check(self, request_id: str = "", weight: int = 1) -> None:
        # A request wider than the whole limit still runs alone, never starves.
        if self.num_inflight and self.num_inflight + weight > self.limit:
            raise self._refuse(request_id, "the cluster is at capacity; retry")

    @contextmanager
    def admitted(self, request_id: str, weight: int = 1) -> Iterator[None]:
        self.check(request_id, weight)
        self.num_inflight += weight
        start = self._clock()
        try:
            yield
        finally:
            self.num_inflight -= weight
            took = self._clock() - start
            self.mean_duration_s = _DECAY * self.mean_duration_s + (1 - _DECAY) * took
            self._refused_since_free = 0
