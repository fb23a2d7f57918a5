"""``structured``: grammar-constrained decoding (JSON Schema) in the pools' engines.

``close_at_budget`` (on by default): a constrained request never ends cut mid-document by its
budget. In the last ``max_closing_tokens`` tokens of its budget (``max_tokens``, and the room
left under ``max_model_len``) the engine keeps the invariant "the grammar's closing of the
current document (``cluster/engine/structured/closing.py``) fits in the tokens left": a sampled
token that would break it is replaced by the closing's first token, so the output always parses
and validates; finish reason ``length``. A request whose schema's shortest document is longer
than its ``max_tokens`` is refused at admission (400 naming ``max_tokens`` and the minimum).
Off: the budget cuts the document where it falls (finish reason ``length``), as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.validation import check


@dataclass(frozen=True)
class StructuredConfig:
    close_at_budget: bool = True
    """Near the end of its budget a constrained request's document is closed by the grammar
    (valid JSON, finish reason ``length``) instead of being cut mid-document."""
    max_closing_tokens: int = 64
    """The window, in tokens, in which the closing is checked (each step, one greedy closing per
    constrained request whose sampled token leaves the closing's path; none before it), and the
    longest closing searched for there; at least the schema's shortest document."""

    def __post_init__(self) -> None:
        check(
            1 <= self.max_closing_tokens <= 4096,
            "structured.max_closing_tokens",
            f"must be in [1, 4096], got {self.max_closing_tokens}",
        )
