"""``scheduler``: the batch one engine step may build (per pool too, under prefill/decode)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.validation import check


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Sequences in one step's batch, at most."""
    max_num_batched_tokens: int = 2048
    """Tokens (prefill chunks + decode tokens) in one step, at most."""
    chunk_size: int | None = 256
    """Prefill tokens per request per step (chunked prefill shares steps with running decodes);
    null: no chunking, a prompt prefills in one step."""

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1")
        check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "scheduler.max_num_batched_tokens",
            f"must be >= scheduler.max_num_seqs ({self.max_num_seqs})",
        )
        if self.chunk_size is not None:
            check(self.chunk_size >= 1, "scheduler.chunk_size", "must be >= 1 (or null)")
