"""``Speculator``: the engine's speculative-decoding collaborator (``decode.speculative``).

Each step, before the scheduler runs (``LLMEngine.schedule``):
  1. ``propose(running)``: which decoding requests draft, and how many tokens, then the
     proposer's guesses. None in a step with more than ``max_batch_size`` decoding requests
     (there the extra rows cost more than they save); none for a paused request; per request
     about what its acceptance rate says will be accepted plus one (at most
     ``num_speculative_tokens``), all of them together at most ``max_num_draft_tokens``
     (shared out evenly); never more than the request may still emit (``max_tokens``) minus
     the token the step samples anyway.
  2. The scheduler feeds each request its last token + drafts (as many as fit) and the runner
     verifies them (``spec.verify``); ``update`` appends the accepted ones.
  3. ``record(item, num_accepted)``: per-request and engine counters, and the adaptive policy:
     an exponential average of each request's accepted / drafted; under
     ``min_acceptance_rate`` the request stops drafting for 2, 4, 8 ... steps (at most
     ``max_pause_steps``), then one verification decides again. Where lookups find nothing,
     nothing is verified, so a workload that never quotes its context pays only the lookups.

Method ``none`` has no proposer: ``propose`` returns nothing and the engine runs as without.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.config import SpeculativeConfig
from cluster.engine.batch import ScheduledRequest
from cluster.engine.request import Request
from cluster.engine.spec.proposer import NgramProposer, Proposer

# decode.speculative.method -> a proposer (config validates the names; "none" has none).
PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": NgramProposer}


@dataclass(slots=True)
class _Track:
    """One request's acceptance history (the adaptive policy's state)."""

    rate: float = 1.0  # exponential average of accepted / drafted, per verification
    pause_steps: int = 0  # steps left without drafting
    num_pauses: int = 0  # consecutive pauses (each twice as long as the last)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.config = config
        self.proposer = proposer
        self._tracks: dict[str, _Track] = {}
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for this step's decoding requests (request id -> tokens; absent: none)."""
        if self.proposer is None:
            return {}
        decoding = [r for r in running if r.num_uncomputed_tokens == 1 and r.output_token_ids]
        if not decoding or len(decoding) > self.config.max_batch_size:
            return {}
        chosen: list[Request] = []
        max_drafts: list[int] = []
        k = self.config.num_speculative_tokens
        for r in decoding:
            track = self._tracks.setdefault(r.request_id, _Track())
            if track.pause_steps:
                track.pause_steps -= 1
                continue
            # About what its acceptance says will be accepted, and one more; the step samples
            # one token after the drafts anyway: room for max_tokens - 1 more.
            n = min(k, math.ceil(track.rate * k) + 1, r.params.max_tokens - r.num_output_tokens - 1)
            if n > 0:
                chosen.append(r)
                max_drafts.append(n)
        budget = self.config.max_num_draft_tokens
        del chosen[budget:], max_drafts[budget:]  # oldest first: one draft each at least
        if not chosen:
            return {}
        share = budget // len(chosen)
        max_drafts = [min(n, share) for n in max_drafts]
        drafts = self.proposer.propose(chosen, max_drafts)
        return {r.request_id: d for r, d in zip(chosen, drafts, strict=True) if d}

    def record(self, item: ScheduledRequest, num_accepted: int) -> None:
        """A verification's outcome: ``num_accepted`` of ``item``'s drafts were accepted."""
        num_drafted = len(item.draft_token_ids)
        if not num_drafted:
            return
        req = item.request
        req.num_draft_tokens += num_drafted
        req.num_accepted_tokens += num_accepted
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        track = self._tracks.setdefault(req.request_id, _Track())
        share = num_accepted / num_drafted
        track.rate = 0.5 * track.rate + 0.5 * share
        floor = self.config.min_acceptance_rate
        if track.rate >= floor:
            if share >= floor:
                track.num_pauses = 0
            return
        track.num_pauses += 1
        track.pause_steps = min(self.config.max_pause_steps, 2**track.num_pauses)
        track.rate = floor  # after the pause, the next verification alone decides

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        drafted = self.num_draft_tokens
        return {
            "method": self.config.method,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_verifications": self.num_verifications,
            "acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
        }


def create_speculator(config: SpeculativeConfig) -> Speculator:
    if config.method == "none":
        return Speculator(config, None)
    try:
        factory = PROPOSERS[config.method]
    except KeyError:
        raise ValueError(
            f"decode.speculative.method: unknown {config.method!r}; "
            f"valid: none, {', '.join(PROPOSERS)}"
        ) from None
    return Speculator(config, factory(config))
