"""Prefill-side leases: which source blocks are held for which transfer, and until when.

Pure bookkeeping (no threads, no sockets, an injectable monotonic clock) so tests can expire a
thousand leases instantly. Lifecycle of one lease:

    LEASED --pull--> SENDING --data handed off--> SENT --ack--> (released: acked)
       |                |                          |
       +-- expiry / abort / peer abort ------------+--> released now, or, if a transport is
                                                        still reading the blocks, DRAINING and
                                                        released once it stops (never earlier)

Invariant: a lease is released exactly once, and never while a transport may still read its
blocks (so the caller can hand them back to its engine the moment it is told).

A streamed lease (``open``) grows while its prefill runs (``extend``); it is pulled in parts,
each ``SENDING -> LEASED`` again at its ack, every block at most once (``sent``), and only
once sealed (``open`` False) may the final pull end it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class LeaseState(enum.Enum):
    LEASED = "leased"
    SENDING = "sending"  # a transport is reading the blocks
    SENT = "sent"  # data handed off; waiting for the ack
    DRAINING = "draining"  # ended (reason set) but a transport is still reading


@dataclass(slots=True)
class Lease:
    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    deadline: float
    state: LeaseState = LeaseState.LEASED
    pull_id: int = 0
    peer: bytes = b""  # routing id of the receiver pulling it
    end_reason: str = ""  # set when ended while DRAINING
    open: bool = False  # streamed and still growing: a final pull is refused until sealed
    final_pull: bool = True  # whether the pull being served ends the lease at its ack
    sent: set[int] = field(default_factory=set)  # blocks served by earlier parts


class LeaseTable:
    _MAX_FINISHED = 1 << 16  # remembered transfer ids, to tell a replay from an unknown id

    def __init__(self, lease_s: float, clock: Callable[[], float]) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}  # transfer_id -> lease
        self._by_request: dict[str, str] = {}  # request_id -> transfer_id
        self._finished: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def add(
        self,
        request_id: str,
        transfer_id: str,
        block_ids: tuple[int, ...],
        *,
        open: bool = False,
        first_s: float | None = None,
    ) -> Lease:
        """``first_s``: the first deadline, if not ``lease_s`` (renewals give ``lease_s``)."""
        if request_id in self._by_request:
            raise ValueError(f"request_id: {request_id!r} already has an active lease")
        if transfer_id in self._leases or transfer_id in self._finished:
            raise ValueError(f"transfer_id: {transfer_id!r} was already used")
        first = self.lease_s if first_s is None else first_s
        lease = Lease(request_id, transfer_id, block_ids, self.clock() + first, open=open)
        self._leases[transfer_id] = lease
        self._by_request[request_id] = transfer_id
        return lease

    def get(self, transfer_id: str) -> Lease | None:
        return self._leases.get(transfer_id)

    def by_request(self, request_id: str) -> Lease | None:
        tid = self._by_request.get(request_id)
        return self._leases.get(tid) if tid is not None else None

    def is_finished(self, transfer_id: str) -> bool:
        return transfer_id in self._finished

    def renew(self, transfer_id: str) -> bool:
        """Push the deadline out (a heartbeat or a pull); False if the lease is gone or ending."""
        lease = self._leases.get(transfer_id)
        if lease is None or lease.state is LeaseState.DRAINING:
            return False
        lease.deadline = self.clock() + self.lease_s
        return True

    def expired(self) -> list[Lease]:
        """Every lease past its deadline, in one pass.

        A full scan rather than a queue ordered by creation: a reaper that stops at the first
        live entry strands the expired ones behind a renewed head (reliability matrix F7). The table
        holds at most one lease per held request, so the scan is cheap.
        """
        now = self.clock()
        return [
            lease
            for lease in self._leases.values()
            if lease.deadline <= now and lease.state in (LeaseState.LEASED, LeaseState.SENT)
        ]

    def remove(self, transfer_id: str) -> Lease:
        lease = self._leases.pop(transfer_id)
        del self._by_request[lease.request_id]
        self._finished[transfer_id] = None
        if len(self._finished) > self._MAX_FINISHED:
            self._finished.popitem(last=False)
        return lease
