"""``decode.speculative``: speculative decoding, a decode-pool feature (the offline engine, which
decodes too, reads the same section: ``LLM(**{"decode.speculative.method": "ngram"})``).

Each step, a proposer guesses up to ``num_speculative_tokens`` next tokens of each decoding
request (``ngram``: prompt lookup, the longest suffix of the request's tokens of
``min_ngram``..``max_ngram`` tokens found earlier in them, and what followed it there); the
model verifies them all in that step's forward, exactly (greedy output is token-identical to no
speculation). Adaptive: a draft is verified when its chance of acceptance (the request's recent
acceptance combined with that of the drafts of the same evidence class, e.g. the same n-gram
match length) pays for its row (one more row's share of a one-row step: measured on the
engine's decode steps with ``measure_row_cost``, ``draft_row_cost`` until then; at most
``num_speculative_tokens``), none under ``min_acceptance_rate``; one that may draft none probes
with one draft and pauses for 2, 4, ... steps (at most ``max_pause_steps``); a step drafts at
most ``max_num_draft_tokens`` in all, the likeliest first, and none with more than
``max_batch_size`` decoding requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from cluster.config.validation import check, check_choices

# The proposer registry's names (cluster.engine.spec.PROPOSERS), plus "none".
SPECULATIVE_METHODS = ("none", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"method": SPECULATIVE_METHODS}

    method: str = "none"
    """The draft proposer (registry ``cluster.engine.spec.PROPOSERS``): ngram is prompt lookup;
    none: no speculation."""
    num_speculative_tokens: int = 8
    """k: draft tokens verified per request per step, at most."""
    min_ngram: int = 2
    """The shortest suffix a lookup may match."""
    max_ngram: int = 8
    """The longest suffix tried (longer matches are preferred and surer)."""
    max_batch_size: int = 16
    """No drafts in a step with more decoding requests than this."""
    max_num_draft_tokens: int = 24
    """Draft tokens per step across the batch, the likeliest first: 24 keeps 8 decoding requests
    (8 + 24 rows) on the CPU's batch-invariant linear kernel (up to 32 rows on AVX2 and
    AVX-512)."""
    draft_row_cost: float = 0.1
    """One more row in a step as a share of a one-row decode step (the prior while measuring);
    the engine drafts only what it expects to pay for."""
    measure_row_cost: bool = True
    """Measure the row cost on the engine's own decode steps (``draft_row_cost`` is the prior
    until the steps span two row counts); false: ``draft_row_cost`` as it is."""
    min_acceptance_rate: float = 0.05
    """A request whose expected per-draft acceptance is under this never drafts (only probes)."""
    max_pause_steps: int = 64
    """A paused request drafts again (a probe) after at most this many steps."""
    grammar_drafts: bool = True
    """Structured output: the tokens a request's grammar forces next are proposed as drafts
    (verified, so exact), whatever the method; at most ``num_speculative_tokens`` a request."""

    def _validate(self, name: str) -> None:
        check_choices(self, name)
        check(
            1 <= self.num_speculative_tokens <= 64,
            f"{name}.num_speculative_tokens",
            f"must be in [1, 64], got {self.num_speculative_tokens}",
        )
        check(self.min_ngram >= 1, f"{name}.min_ngram", f"must be >= 1, got {self.min_ngram}")
        check(
            self.max_ngram >= self.min_ngram,
            f"{name}.max_ngram",
            f"must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}",
        )
        check(
            self.max_batch_size >= 1,
            f"{name}.max_batch_size",
            f"must be >= 1, got {self.max_batch_size}",
        )
        check(
            self.max_num_draft_tokens >= 1,
            f"{name}.max_num_draft_tokens",
            f"must be >= 1, got {self.max_num_draft_tokens}",
        )
        check(
            0.0 <= self.draft_row_cost <= 10.0,
            f"{name}.draft_row_cost",
            f"must be in [0, 10], got {self.draft_row_cost}",
        )
        check(
            0.0 <= self.min_acceptance_rate < 1.0,
            f"{name}.min_acceptance_rate",
            f"must be in [0, 1), got {self.min_acceptance_rate}",
        )
        check(
            self.max_pause_steps >= 1,
            f"{name}.max_pause_steps",
            f"must be >= 1, got {self.max_pause_steps}",
        )

    @property
    def enabled(self) -> bool:
        return self.method != "none"
