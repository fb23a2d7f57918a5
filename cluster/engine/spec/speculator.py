"""``Speculator``: the engine's speculative-decoding collaborator (``decode.speculative``).

Each step, before the scheduler runs (``LLMEngine.schedule``):
  1. ``propose(running)``: the proposer's guesses for each decoding request (up to
     ``num_speculative_tokens``, never more than the request may still emit minus the token the
     step samples anyway), then how many of them to verify. A draft pays when the chance it is
     accepted beats what its row costs: with B decoding requests and one more row costing
     ``draft_row_cost`` of a one-row step, the j-th draft is worth verifying while
     ``p ** j > B c / (1 + B c)`` (floor ``min_acceptance_rate``). p (``acceptance``) combines
     two estimates on the odds: the request's recent acceptance and that of the recent drafts
     of the same evidence class (``Drafts.evidence``; the n-gram proposer's matched length),
     each against the engine-wide average. The step's ``max_num_draft_tokens`` go to the
     likeliest drafts first (the chance that draft j and all before it are accepted), so a
     request that matched a long suffix drafts deep and one that matched two tokens at batch 8
     none; of those, the step takes as many as give it the most tokens a second (B + their
     chances over ``StepCost.step_time`` at that many rows: where a row tile fills, the next
     row costs far more than the line says). Nothing with more than ``max_batch_size``
     decoding requests.
  2. The scheduler feeds each request its last token + drafts (as many as fit) and the runner
     verifies them (``spec.verify``); ``update`` appends the accepted ones.
  3. ``record(item, num_accepted)``: per-request, per-class and engine counters, and the
     estimates: accepted / tried drafts (those up to and including the first rejection), both
     decayed per verification (``_DECAY`` for a request, ``_CLASS_DECAY`` for a class and for
     all), from a prior of 0.8. Drafts that do not pay are not verified, except for a probe of
     one now and then (after 2, 4, 8 ... such steps of the request, at most
     ``max_pause_steps``), so every estimate keeps learning; drafts that pay are verified
     whenever they come. Where lookups find nothing nothing is verified: a workload that never
     quotes its context pays only the lookups.
  4. ``observe_step(items, seconds)``: the runner's time for each decode-only step; what a
     draft row costs against a step without drafts is measured from them (``StepCost``), and
     the threshold above becomes b B / t_B (``draft_row_cost`` is only the prior;
     ``measure_row_cost: false`` keeps it). It differs by an order of magnitude between
     paths: ~0.1 for dense fp32 weights on a CPU (a step streams the weights once, rows are
     nearly free), ~0.4 for GGUF blocks (the kernels compute each row), less on a GPU.

Method ``none`` has no proposer: ``propose`` returns nothing and the engine runs as without.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.config import SpeculativeConfig
from cluster.engine.batch import ScheduledRequest
from cluster.engine.request import Request
from cluster.engine.spec.proposer import NgramProposer, Proposer
from cluster.engine.spec.step_cost import StepCost

# decode.speculative.method -> a proposer (config validates the names; "none" has none).
PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": NgramProposer}

_DECAY = 0.8  # weight of a request's older verifications in its acceptance estimate
_CLASS_DECAY = 0.95  # the same for an evidence class's (and all drafts') estimate, engine-wide
_P_MAX = 0.995  # no estimate is surer than this
_PRIOR_ACCEPTED, _PRIOR_TRIED = 1.6, 2.0  # before any verification: p = 0.8


@dataclass(slots=True)
class _Acceptance:
    """One request's acceptance history (the adaptive policy's state)."""

    accepted: float = _PRIOR_ACCEPTED  # decayed sums of accepted and of tried drafts
    tried: float = _PRIOR_TRIED
    pause_steps: int = 0  # steps left without drafting
    num_pauses: int = 0  # consecutive pauses (each twice as long as the last)

    @property
    def p(self) -> float:
        return self.accepted / self.tried

    def add(self, accepted: int, tried: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.tried = decay * self.tried + tried


def _odds(p: float) -> float:
    p = min(_P_MAX, max(1.0 - _P_MAX, p))
    return p / (1.0 - p)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.config = config
        self.proposer = proposer
        self._tracks: dict[str, _Acceptance] = {}
        self._classes: dict[int, _Acceptance] = {}  # by the proposer's evidence class
        self._overall = _Acceptance()
        # this step's proposals: request id -> (evidence class, drafts)
        self._evidence: dict[str, tuple[int, list[int]]] = {}
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

    def threshold(self, batch: int) -> float:
        return max(self.config.min_acceptance_rate, self.step_cost.threshold(batch))

    def acceptance(self, request_id: str, evidence: int) -> float:
        """A draft's chance, from two estimates: the request's recent acceptance and that of
        all drafts of the same evidence class (e.g. the n-gram match length), combined as
        independent evidence on the odds, each against the engine-wide average."""
        track = self._tracks.get(request_id)
        p_req = track.p if track is not None else _PRIOR_ACCEPTED / _PRIOR_TRIED
        cls = self._classes.get(evidence)
        if cls is None:
            return p_req
        odds = _odds(p_req) * _odds(cls.p) / _odds(self._overall.p)
        return min(_P_MAX, odds / (1.0 + odds))

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for this step's decoding requests (request id -> tokens; absent: none)."""
        self._evidence.clear()  # this step's only (its ``record`` calls come before the next)
        if self.proposer is None:
            return {}
        decoding = [r for r in running if r.num_uncomputed_tokens == 1 and r.output_token_ids]
        if not decoding or len(decoding) > self.config.max_batch_size:
            return {}
        asked, room = self._room(decoding)
        if not asked:
            return {}
        proposals = self.proposer.propose(asked, room)
        classes = [getattr(d, "evidence", 0) for d in proposals]  # a plain list: class 0
        take = self._allot(asked, proposals, classes, len(decoding))
        out: dict[str, list[int]] = {}
        for r, drafts, cls, n in zip(asked, proposals, classes, take, strict=True):
            if n:
                out[r.request_id] = list(drafts[:n])
                self._evidence[r.request_id] = (cls, out[r.request_id])
        return out

    def _room(self, decoding: Sequence[Request]) -> tuple[list[Request], list[int]]:
        """The requests that may draft (their output has room past the next token) and how
        many drafts each may take."""
        asked: list[Request] = []
        room: list[int] = []
        for r in decoding:
            n = min(
                self.config.num_speculative_tokens, r.params.max_tokens - r.num_output_tokens - 1
            )
            if n > 0:
                asked.append(r)
                room.append(n)
        return asked, room

    def _allot(
        self,
        asked: Sequence[Request],
        proposals: Sequence[Sequence[int]],
        classes: Sequence[int],
        batch: int,
    ) -> list[int]:
        """How many of its drafts each request verifies this step, within the step's budget."""
        # (chance that drafts 1..j of a request are all accepted, its index, j): the step's
        # budget goes to the likeliest first, so a sure request drafts deep, a doubtful none.
        threshold = self.threshold(batch)
        candidates: list[tuple[float, int, int]] = []
        probes: list[int] = []
        for i, (r, drafts) in enumerate(zip(asked, proposals, strict=True)):
            if not drafts:
                continue
            p = self.acceptance(r.request_id, classes[i])
            if p <= threshold:  # not worth it now: a probe of one draft now and then
                if self._probe_due(r.request_id):
                    probes.append(i)
                continue
            chance = 1.0
            for j in range(1, len(drafts) + 1):
                chance *= p
                if chance <= threshold:
                    break
                candidates.append((chance, i, j))
        budget = self.config.max_num_draft_tokens
        take = [0] * len(asked)
        for i in probes[:budget]:  # oldest first
            take[i] = 1
        budget -= sum(take)
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep the oldest request first
        for _chance, i, j in candidates[: self._most_tokens(candidates, batch, sum(take), budget)]:
            take[i] = max(take[i], j)
        return take

    def _most_tokens(
        self, candidates: Sequence[tuple[float, int, int]], batch: int, probes: int, budget: int
    ) -> int:
        """How many of the likeliest ``candidates`` give the step the most tokens a second: B +
        the chances taken (expected tokens) over the step's time at that many rows
        (``StepCost.step_time``). With a linear cost that is the threshold's rule again; with
        the kernels' staircase it stops where a row tile is full, not one row past it."""
        cost = self.step_cost
        best_m, best = 0, batch / cost.step_time(batch, probes)
        expected = float(batch)
        for m, (chance, _i, _j) in enumerate(candidates[: max(0, budget)], 1):
            expected += chance
            rate = expected / cost.step_time(batch, probes + m)
            if rate > best:
                best_m, best = m, rate
        return best_m

    def _probe_due(self, request_id: str) -> bool:
        """A request not worth drafting for now: True when no pause of its is running, and it
        then drafts one token (a probe) and starts its next pause, each twice the last (up to
        ``max_pause_steps``)."""
        track = self._tracks.setdefault(request_id, _Acceptance())
        if track.pause_steps:
            track.pause_steps -= 1
            return False
        track.num_pauses += 1
        track.pause_steps = min(self.config.max_pause_steps, 2**track.num_pauses)
        return True

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
        tried = min(num_accepted + 1, num_drafted)
        track = self._tracks.setdefault(req.request_id, _Acceptance())
        track.add(num_accepted, tried, _DECAY)
        # The class of the drafts proposed here; drafts from elsewhere (a grammar's forced
        # tokens, ``structured``) count as class 0.
        evidence, proposed = self._evidence.pop(req.request_id, (0, []))
        if item.draft_token_ids != proposed[:num_drafted]:
            evidence = 0
        self._classes.setdefault(evidence, _Acceptance()).add(num_accepted, tried, _CLASS_DECAY)
        self._overall.add(num_accepted, tried, _CLASS_DECAY)
        if self.acceptance(req.request_id, evidence) > self.threshold(1):
            track.num_pauses = 0

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def export_track(self, request_id: str) -> tuple[float, float, int, int] | None:
        """A request's acceptance history, for the replica that takes it over (migration)."""
        t = self._tracks.get(request_id)
        return None if t is None else (t.accepted, t.tried, t.pause_steps, t.num_pauses)

    @staticmethod
    def check_track(track: tuple[float, float, int, int]) -> None:
        """ValueError unless ``track`` is an acceptance history (``export_track``'s shape)."""
        accepted, tried, pause_steps, num_pauses = track
        if not (0.0 <= accepted <= tried and tried > 0.0 and pause_steps >= 0 <= num_pauses):
            raise ValueError(f"spec_track: {track!r} is not an acceptance history")

    def import_track(self, request_id: str, track: tuple[float, float, int, int]) -> None:
        self.check_track(track)
        accepted, tried, pause_steps, num_pauses = track
        self._tracks[request_id] = _Acceptance(
            float(accepted), float(tried), max(0, int(pause_steps)), max(0, int(num_pauses))
        )

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
