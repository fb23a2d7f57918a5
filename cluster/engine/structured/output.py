"""``StructuredOutput``: the engine's grammar-constrained decoding collaborator (llguidance).

A request whose ``SamplingParams.json_schema`` is set gets a matcher (``check`` compiles the
schema at admission, ``ValueError`` naming the problem; ``add`` starts the matcher and replays
the request's accepted tokens, so a decode replica that received the prefill replica's first
token rebuilds the state from the schema and the tokens alone). Each step:

  * ``drafts``: the tokens the grammar forces next (a fixed key, a closing brace) are proposed
    as drafts, verified like any other (so the output distribution is unchanged: jump-forward
    in its exact form); another proposer's drafts are cut at the first the grammar refuses;
  * ``masks``: the batch's token masks, filled while the model runs (``masks.BatchMasks``);
  * ``choose`` (from ``OutputProcessor``, before a token is appended): near the end of the
    budget the document is closed within it (``budget.BudgetGuard``, ``structured.close_at_
    budget``): a sampled token after which the closing would not fit is replaced by the
    closing's; drafts are cut to what the budget allows (in ``drafts``);
  * ``advance`` (from ``OutputProcessor``): every accepted token moves the matcher on; the
    request stops (``stop``; ``length`` if the budget closed it) once the grammar is complete.

``forget`` frees a request's matcher when it finishes, is aborted or handed off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance

from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig, cpu_count
from cluster.engine.batch import ScheduledRequest
from cluster.engine.request import Request, RequestStatus
from cluster.engine.runner import resolve_device
from cluster.engine.structured.budget import BudgetGuard
from cluster.engine.structured.grammar import GrammarCache, build_vocab
from cluster.engine.structured.masks import BatchMasks, MaskRow


class StructuredOutput:
    def __init__(
        self, config: ClusterConfig, tokenizer: Any, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.close_at_budget = config.structured.close_at_budget
        self.closing_window = config.structured.max_closing_tokens
        self._guard: BudgetGuard | None = None  # built with the cache, if close_at_budget
        self.max_schema_bytes = config.router.max_json_schema_bytes
        spec = config.decode.speculative
        self.forced_drafts = spec.grammar_drafts
        self.max_drafts = spec.num_speculative_tokens
        self.max_step_drafts = spec.max_num_draft_tokens
        self._cache: GrammarCache | None = None  # built on the first structured request
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._overlap = resolve_device(config).type == "cuda"  # fill masks beside the forward
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self.num_forced_drafts = 0

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            vocab = build_vocab(self.tokenizer, self.vocab_size)
            self._cache = GrammarCache(vocab, self.max_schema_bytes)
            if self.close_at_budget:
                self._guard = BudgetGuard(self._cache.closer, self.closing_window, vocab.eos_token)
        return self._cache

    def _left(self, req: Request) -> int:
        """The tokens ``req`` may still append (``max_tokens``, ``max_model_len``)."""
        return min(
            req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens
        )

    # -- per request ---------------------------------------------------------------------------

    def check(self, params: SamplingParams) -> None:
        """Compile (and cache) the request's grammar; ``ValueError`` naming the problem (with
        ``close_at_budget``: a ``max_tokens`` below the schema's shortest document too)."""
        if params.json_schema is None:
            return
        self.cache.matcher(params.json_schema)
        shortest = self.cache.shortest(params.json_schema)
        if self.close_at_budget and shortest is not None and len(shortest) > params.max_tokens:
            raise ValueError(
                f"max_tokens: {params.max_tokens} is too small for the json_schema: its "
                f"shortest document takes {len(shortest)} tokens, so max_tokens must be >= "
                f"{len(shortest)} (structured.close_at_budget)"
            )

    def add(self, req: Request) -> None:
        schema = req.params.json_schema
        if schema is None:
            return
        matcher = self.cache.matcher(schema)
        if self._guard is not None:
            self._guard.start(req.request_id, self.cache.shortest(schema))
        first_left = self._left(req) + req.num_output_tokens
        for i, token_id in enumerate(req.output_token_ids):  # replayed as they were appended
            if self._guard is not None:
                self._guard.choose(req.request_id, matcher, token_id, first_left - i)
            if not matcher.consume_token(token_id):
                self.forget(req.request_id)
                raise ValueError(
                    f"json_schema: the request's tokens do not match it: {matcher.get_error()}"
                )
        self._matchers[req.request_id] = matcher

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        if self._guard is not None:
            self._guard.forget(request_id)

    def choose(self, req: Request, token_id: int) -> int:
        """The token ``req`` appends for the sampled ``token_id``: itself, or (the budget at
        risk) the first of the grammar's closing of the document."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None or self._guard is None:
            return token_id
        return self._guard.choose(req.request_id, matcher, token_id, self._left(req))

    def active_ids(self) -> set[str]:
        return set(self._matchers)

    def advance(
        self, req: Request, token_id: int, status: RequestStatus | None
    ) -> RequestStatus | None:
        """Move ``req``'s matcher over a token just appended; returns its status: ``status``, or
        stopped once the grammar is complete (an error if the token breaks it)."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None or matcher.is_stopped():  # complete: only EOS could follow
            return status
        if not matcher.consume_token(token_id):
            req.error = f"json_schema: token {token_id} does not match: {matcher.get_error()}"
            return RequestStatus.FINISHED_ERROR
        if status is None and matcher.is_stopped():
            closed = self._guard is not None and self._guard.closed(req.request_id)
            return RequestStatus.FINISHED_LENGTH if closed else RequestStatus.FINISHED_STOPPED
        return status

    # -- per step ------------------------------------------------------------------------------

    def drafts(
        self, running: Sequence[Request], proposed: Mapping[str, list[int]]
    ) -> Mapping[str, list[int]]:
        """``proposed`` (request id -> drafts), with constrained requests' drafts replaced by the
        tokens their grammar forces, or cut where the grammar refuses them."""
        if not self._matchers:
            return proposed
        out = dict(proposed)
        budget = self.max_step_drafts
        for r in running:
            matcher = self._matchers.get(r.request_id)
            if matcher is None or r.num_uncomputed_tokens != 1 or not r.output_token_ids:
                continue
            room = min(self.max_drafts, budget, r.params.max_tokens - r.num_output_tokens - 1)
            drafts = out.pop(r.request_id, [])
            if self.forced_drafts and room > 0:
                forced = matcher.compute_ff_tokens()[:room]
                self.num_forced_drafts += len(forced)
                drafts = forced or drafts
            drafts = drafts[: max(0, min(room, matcher.validate_tokens(drafts)))]
            if drafts and self._guard is not None:
                drafts = drafts[: self._guard.room(r.request_id, matcher, drafts, self._left(r))]
            if drafts:
                out[r.request_id] = drafts
                budget -= len(drafts)
        return out

    def masks(self, items: Sequence[ScheduledRequest]) -> BatchMasks | None:
        """Start filling this step's masks (None: no constrained request samples)."""
        if not self._matchers:
            return None
        rows: list[MaskRow] = []
        num_rows = 0
        for it in items:
            matcher = self._matchers.get(it.request.request_id)
            if matcher is not None and it.samples:
                rows.append((it.request.request_id, matcher, num_rows, list(it.draft_token_ids)))
                num_rows += it.num_sampled_rows
        if not rows:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, cpu_count())))
            if self._overlap:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        return BatchMasks(self._pool, self._executor, rows, num_rows, self.cache.vocab)

    def stats(self) -> dict[str, Any]:
        return {
            "num_active": len(self._matchers),
            "num_compiled": self._cache.num_compiled if self._cache is not None else 0,
            "num_forced_drafts": self.num_forced_drafts,
            **(self._guard.stats() if self._guard is not None else {}),
        }
