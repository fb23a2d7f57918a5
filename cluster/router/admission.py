"""Admission control at a router replica: a fast RESOURCE_EXHAUSTED / 429 instead of a queue.

At most ``limit`` requests are in flight here at once (``serving.options.router_admission_limit``:
what the decode pool can hold). ``check`` is the cheap test each API runs first, before reading
or parsing anything, so an overloaded router refuses in microseconds; ``admitted`` holds the
place for the request's whole stream (the one check that counts, under the race).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cluster.common.errors import ErrorCode, PDServeError


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_inflight = 0
        self.num_rejected = 0

    def check(self, request_id: str = "") -> None:
        if self.num_inflight >= self.limit:
            self.num_rejected += 1
            raise PDServeError(
                ErrorCode.RESOURCE_EXHAUSTED, "the cluster is at capacity; retry", request_id
            )

    @contextmanager
    def admitted(self, request_id: str) -> Iterator[None]:
        self.check(request_id)
        self.num_inflight += 1
        try:
            yield
        finally:
            self.num_inflight -= 1
