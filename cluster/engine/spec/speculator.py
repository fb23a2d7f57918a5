"""``Speculator``: the engine's speculative-decoding collaborator (``decode.speculative``).

Each step, before the scheduler runs (``LLMEngine.schedule``):
  1. ``propose(running)``: how many tokens each decoding request drafts, then the proposer's
     guesses. A draft pays when the chance it is accepted beats what its row costs: with B
     decoding requests and one more row costing ``draft_row_cost`` of a one-row step, the
     j-th draft is worth verifying while ``p ** j > B c / (1 + B c)`` (p: the request's
     per-draft acceptance, estimated below; floor ``min_acceptance_rate``). So a copying
     request at batch 1 drafts many, one at batch 8 a few, one that never copies none. At
     most ``num_speculative_tokens`` per request and ``max_num_draft_tokens`` per step (shared
     out evenly), nothing with more than ``max_batch_size`` decoding requests, never more than
     the request may still emit (``max_tokens``) minus the token the step samples anyway.
  2. The scheduler feeds each request its last token + drafts (as many as fit) and the runner
     verifies them (``spec.verify``); ``update`` appends the accepted ones.
  3. ``record(item, num_accepted)``: per-request and engine counters, and the estimate of p:
     accepted / tried drafts (those up to and including the first rejection), both decayed by
     ``_DECAY`` per verification, from a prior of 0.8. A request whose p allows no draft
     pauses and probes with one draft after 2, 4, 8 ... steps (at most ``max_pause_steps``).
     Where lookups find nothing nothing is verified: a workload that never quotes its context
     pays only the lookups.
  4. ``observe_step(items, seconds)``: the runner's time for each decode-only step; what a
     draft row costs against a step without drafts is measured from them (``StepCost``), and
     the threshold above becomes b B / t_B (``draft_row_cost`` is only the prior;
     ``measure_row_cost: false`` keeps it). It differs by an order of magnitude between
     paths: ~0.1 for dense fp32 weights on a CPU (a step streams the weights once, rows are
     nearly free), ~0.4 for GGUF blocks (the kernels compute each row), less on a GPU.

Method ``none`` has no proposer: ``propose`` returns nothing and the engine runs as without.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.config import SpeculativeConfig
from cluster.engine.batch import ScheduledRequest
from cluster.engine.request import Request
from cluster.engine.spec.proposer import NgramProposer, Proposer

# decode.speculative.method -> a proposer (config validates the names; "none" has none).
PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": NgramProposer}

_DECAY = 0.8  # weight of a request's older verifications in its acceptance estimate
_PRIOR_ACCEPTED, _PRIOR_TRIED = 1.6, 2.0  # before any verification: p = 0.8


class StepCost:
    """What a draft row costs, measured on the engine's own decode-only steps.

    The runner's time of such a step is fitted as t = a + e B + b D (B decoding requests, D
    draft rows) by least squares over the recent steps (each older one weighs ``decay`` as
    much): b is a draft row's cost and t_B = a + e B the step's cost without drafts, so a
    request's j-th draft pays while p ** j > b B / t_B (``threshold``). Until ``min_steps``
    steps are fitted and D varies apart from B, the prior stands: one more row costs ``prior``
    of a one-row step (the config's ``draft_row_cost``), threshold c B / (1 + c B).
    """

    def __init__(self, prior: float, decay: float = 0.98, min_steps: int = 16) -> None:
        self.prior = prior
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        self._zz = np.zeros((3, 3))  # decayed sums of z z^T and z t, z = (1, B, D)
        self._zt = np.zeros(3)
        self._fit: tuple[float, float, float] | None = None  # (a, e, b)
        self._stale = False

    def observe(self, requests: int, drafts: int, seconds: float) -> None:
        z = np.array((1.0, float(requests), float(drafts)))
        self._zz = self.decay * self._zz + np.outer(z, z)
        self._zt = self.decay * self._zt + z * seconds
        self.num_steps += 1
        self._stale = True

    def fit(self) -> tuple[float, float, float] | None:
        """(a, e, b), or None while the steps do not tell a draft row's cost apart."""
        if not self._stale:
            return self._fit
        self._stale = False
        self._fit = None
        m = self._zz
        if self.num_steps < self.min_steps:
            return None
        # What is left of D's spread once 1 and B explain what they can: b's information.
        base = m[:2, :2]
        left = m[2, 2] - m[2, :2] @ np.linalg.pinv(base) @ m[:2, 2]
        if left < 0.25 * m[0, 0]:
            return None
        a, e, b = (float(v) for v in np.linalg.pinv(m) @ self._zt)
        self._fit = (a, e, b)
        return self._fit

    def threshold(self, batch: int) -> float:
        """The per-draft acceptance a request's drafts must beat at ``batch`` requests."""
        fit = self.fit()
        if fit is None:
            c = self.prior * batch
            return c / (1 + c)
        a, e, b = fit
        step = a + e * batch
        if step <= 0.0:
            c = self.prior * batch
            return c / (1 + c)
        return min(0.99, max(0.0, b * batch / step))

    @property
    def row_cost(self) -> float:
        """A draft row's share of a one-request step (the prior until measured)."""
        fit = self.fit()
        if fit is None or fit[0] + fit[1] <= 0.0:
            return self.prior
        a, e, b = fit
        return max(0.0, b / (a + e))


@dataclass(slots=True)
class _Track:
    """One request's acceptance history (the adaptive policy's state)."""

    accepted: float = _PRIOR_ACCEPTED  # decayed sums of accepted and of tried drafts
    tried: float = _PRIOR_TRIED
    pause_steps: int = 0  # steps left without drafting
    num_pauses: int = 0  # consecutive pauses (each twice as long as the last)

    @property
    def p(self) -> float:
        return self.accepted / self.tried


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.config = config
        self.proposer = proposer
        self._tracks: dict[str, _Track] = {}
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.step_cost = StepCost(config.draft_row_cost)

    def observe_step(self, items: Sequence[ScheduledRequest], seconds: float) -> None:
        """The runner's time for a step: decode-only steps (drafts or not) feed ``step_cost``."""
        if self.proposer is None or not self.config.measure_row_cost or not items:
            return
        if all(it.request.output_token_ids and it.samples for it in items):
            drafts = sum(len(it.draft_token_ids) for it in items)
            if sum(it.num_new_tokens for it in items) == len(items) + drafts:
                self.step_cost.observe(len(items), drafts, seconds)

    def worth(self, p: float, batch: int) -> int:
        """How many drafts pay for a request of per-draft acceptance ``p`` in a batch."""
        threshold = max(self.config.min_acceptance_rate, self.step_cost.threshold(batch))
        if p <= threshold:
            return 0
        if p >= 1.0 or threshold <= 0.0:
            return self.config.num_speculative_tokens
        return min(self.config.num_speculative_tokens, math.ceil(math.log(threshold, p)) - 1)

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for this step's decoding requests (request id -> tokens; absent: none)."""
        if self.proposer is None:
            return {}
        decoding = [r for r in running if r.num_uncomputed_tokens == 1 and r.output_token_ids]
        if not decoding or len(decoding) > self.config.max_batch_size:
            return {}
        chosen: list[Request] = []
        max_drafts: list[int] = []
        for r in decoding:
            track = self._tracks.setdefault(r.request_id, _Track())
            n = self.worth(track.p, len(decoding))
            if n == 0:  # not worth it now: probe with one draft once the pause is over
                if track.pause_steps:
                    track.pause_steps -= 1
                    continue
                track.num_pauses += 1
                track.pause_steps = min(self.config.max_pause_steps, 2**track.num_pauses)
                n = 1
            n = min(n, r.params.max_tokens - r.num_output_tokens - 1)
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
        track.accepted = _DECAY * track.accepted + num_accepted
        track.tried = _DECAY * track.tried + min(num_accepted + 1, num_drafted)
        if self.worth(track.p, 1):
            track.num_pauses = 0

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
            "row_cost": self.step_cost.row_cost,
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
