"""What one step runs: the plain dataclasses the scheduler hands the runner (and ``update``).

The runner reads them and never decides who runs; the scheduler never touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.engine.handoff import KVReservation
from cluster.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step: ``num_new_tokens`` from ``request.num_computed_tokens`` on.

    A decoding request with drafts feeds its last token then the drafts (``1 + k`` tokens, slots
    reserved for all of them); each of those positions is sampled and the drafts are accepted
    while they equal what was sampled before them. Rejected positions are not computed tokens:
    their slots are overwritten later.
    """

    request: Request
    num_new_tokens: int  # fed this step, from request.num_computed_tokens on (drafts included)
    block_ids: list[int]  # the request's live block table (read-only for the runner)
    # Proposed tokens after the request's last one (decoding only): fed after it and verified.
    draft_token_ids: list[int] = field(default_factory=list)
    # Samples of the request (``parallel``) whose first token is drawn from this item's last
    # row too, each with its own seed: the prompt's last block is full, so they share all of it.
    fanout: list[Request] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        r = self.request
        num_known = self.num_new_tokens - len(self.draft_token_ids)
        return r.num_computed_tokens + num_known == r.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Positions whose logits are sampled: the last known token's and each draft's."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    def input_token_ids(self) -> list[int]:
        """The tokens fed this step: known ones from ``num_computed_tokens`` on, then drafts."""
        r = self.request
        start = r.num_computed_tokens
        end = start + self.num_new_tokens - len(self.draft_token_ids)
        if end == start + 1:  # a decode: the token sampled last step
            return [r.token_at(start), *self.draft_token_ids]
        known = r.prompt_token_ids if end <= r.num_prompt_tokens else r.all_token_ids
        return known[start:end] + self.draft_token_ids


class TokenMasks(Protocol):
    """A step's grammar masks (``structured.BatchMasks``), applied before any row is sampled."""

    def apply(self, logits: Any, items: Sequence[ScheduledRequest]) -> Any: ...


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    reservations: list[KVReservation] = field(default_factory=list)
    num_deferred: int = 0  # waiting requests held back for a prefix block being computed
    masks: TokenMasks | None = None  # structured output: constrained rows' token masks

    @property
    def is_empty(self) -> bool:
        return not self.items
