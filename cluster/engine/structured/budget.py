"""``BudgetGuard``: a constrained request's document always closes within its budget.

The invariant, kept for every constrained request in the last ``window`` tokens of its budget
(``left``: the tokens it may still append, under ``max_tokens`` and ``max_model_len``): the
grammar's closing of the current document (``closing.Closer``) fits in ``left``. Kept exactly:

  * ``choose`` (each token a step appends, before it is appended): a token on the closing's path
    keeps it (the rest of the closing is the new one); another token is checked: the closing
    after it must fit in ``left - 1``, else the closing's first token replaces it (EOS when the
    document is already complete). Only the step's last token can be replaced: its KV is not
    computed yet, it is the next step's input;
  * ``room`` (drafts, before the step): drafts before the window are free; in it, drafts stay
    only while they follow the closing (forced tokens do); a draft run that crosses into the
    window is cut there.

Outside the window nothing runs: any closing found there has at most ``window`` tokens, and
``left - 1 >= window``. Entering it, the closing of the state is computed once; if none fits
(the model nested deeper than the window can close), the request is ``lost``: the budget may
cut it, as without the guard (counted in ``stats``). Everything is a function of the schema,
the tokens and the budget, so a decode replica that replays the tokens decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llguidance

from cluster.engine.structured.closing import Closer


@dataclass(slots=True)
class _Closing:
    """One request's state in the budget guard: its window and the closing kept for it."""

    window: int  # the last tokens of the budget in which the closing is kept
    plan: list[int] | None = None  # the closing of the current state, once in the window
    lost: bool = False  # in the window with no closing that fits
    closed: bool = False  # a token was replaced by the closing's


class BudgetGuard:
    def __init__(self, closer: Closer, window: int, eos: int) -> None:
        self.closer = closer
        self.window = window
        self.eos = eos
        self._tracks: dict[str, _Closing] = {}
        self.num_closed = 0  # requests whose document the budget closed
        self.num_closing_tokens = 0  # tokens the closing chose instead of the sampled ones
        self.num_lost = 0  # requests the window could not close

    def start(self, request_id: str, min_plan: list[int] | None) -> None:
        """Track a request; ``min_plan``: the closing of its schema's empty document."""
        shortest = len(min_plan) if min_plan is not None else 0
        self._tracks[request_id] = _Closing(window=max(self.window, shortest))

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    def closed(self, request_id: str) -> bool:
        track = self._tracks.get(request_id)
        return track is not None and track.closed

    def _plan(self, track: _Closing, matcher: llguidance.LLMatcher, left: int) -> list[int] | None:
        """The closing of the current state, computed on entering the window."""
        if track.plan is None and not track.lost:
            track.plan = self.closer.plan(matcher, max_len=left)
            if track.plan is None:
                track.lost = True
                self.num_lost += 1
        return None if track.lost else track.plan

    def choose(self, request_id: str, matcher: llguidance.LLMatcher, token: int, left: int) -> int:
        """The token to append for a sampled ``token`` with ``left`` tokens of budget left."""
        track = self._tracks.get(request_id)
        if track is None or left - 1 >= track.window or matcher.is_stopped():
            return token
        plan = self._plan(track, matcher, left)
        if plan is None:
            return token
        if plan and plan[0] == token:
            track.plan = plan[1:]
            return token
        if matcher.validate_tokens([token]) != 1:
            return token  # the grammar refuses it: ``advance`` reports the error
        after = self.closer.plan(matcher, max_len=left - 1, then=token)
        if after is not None:
            track.plan = after
            return token
        if not track.closed:
            track.closed = True
            self.num_closed += 1
        self.num_closing_tokens += 1
        if not plan:  # the document is complete; what the model wanted would not close again
            return self.eos
        track.plan = plan[1:]
        return plan[0]

    def room(
        self, request_id: str, matcher: llguidance.LLMatcher, drafts: list[int], left: int
    ) -> int:
        """How many of ``drafts`` (proposed with ``left`` tokens of budget left) may stay."""
        track = self._tracks.get(request_id)
        if track is None or track.lost:
            return len(drafts)
        free = max(0, left - track.window)  # draft j is free while left - j >= window
        if free:
            return min(free, len(drafts))
        plan = self._plan(track, matcher, left)
        if plan is None:
            return len(drafts)
        n = 0
        while n < len(drafts) and n < len(plan) and drafts[n] == plan[n]:
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "num_closed": self.num_closed,
            "num_closing_tokens": self.num_closing_tokens,
            "num_closing_lost": self.num_lost,
            "num_closing_plans": self.closer.num_plans,
        }
