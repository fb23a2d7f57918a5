"""A request is counters: prefill, chunk and decode state derive from them, never from flags."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from cluster.common.hashing import NONE_HASH, hash_block_tokens
from cluster.common.sampling_params import SamplingParams

__all__ = [
    "EngineRequest",
    "FinishReason",
    "PrefillMode",
    "Request",
    "RequestStatus",
    "Resume",
    "SamplingParams",
]

# How a request's prompt gets its KV: computed here, pulled from a prefill replica, or (decode
# role) remote when more than ``decode.local_prefill_threshold`` tokens are not cached here.
PrefillMode = Literal["local", "remote", "auto"]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request as a caller hands it to an engine: built once (a pool worker, the offline
    ``LLM``, a test) and passed down unchanged through ``EngineClient.add``, ``EngineLoop.add``
    and ``LLMEngine.add``, which validates it (``ValueError`` naming the field)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    prefill: PrefillMode = "local"
    seed: int | None = None  # None: ``params.seed``, else one the engine draws
    arrival_time: float | None = None  # monotonic; None: when the engine takes it
    n: int = 1  # samples of the prompt (``parallel``), streamed to one sink
    resume: Resume | None = None  # a request taken over from another decode replica


@dataclass(frozen=True, slots=True)
class Resume:
    """Live migration (decode role, ``prefill="remote"``): what a request brings from the decode
    replica it leaves. ``token_ids``, the outputs that replica streamed, are taken in without an
    output; the KV of the prompt and of all of them but the last is pulled into the reserved
    blocks (``LLMEngine.kv_arrived``). The draft counts and the acceptance track carry the
    speculation's history over."""

    token_ids: Sequence[int]
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_track: tuple[float, float, int, int] | None = None


class RequestStatus(enum.IntEnum):
    """One ordered lifecycle. Everything ``> PREEMPTED`` is finished. A live status also names
    the engine's collaborator that holds the request (``LLMEngine``'s one request table)."""

    WAITING = 0  # the scheduler's waiting queue
    WAITING_FOR_KV = 1  # decode role: kept by the hand-off until its prompt's KV has arrived
    WAITING_FOR_LEADER = 2  # a sample (n > 1), kept until its leader's prompt KV is computed
    RUNNING = 3  # the scheduler's running batch
    PREEMPTED = 4  # the scheduler's waiting queue, to be recomputed
    # decode role: paused, its blocks leased to another decode replica that is taking it over
    # (live migration); kept by the hand-off until that pull is acked (it ends) or not (resumes)
    MIGRATING = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.MIGRATING

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the effective seed (params.seed or one drawn by the engine)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # params.prompt_logprobs: position p's (logprob of prompt token p + 1, top k), p < P - 1
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Tokens whose KV is in the cache (prompt first, then outputs). All state derives from it.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at admission (for metrics)
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative drafts verified for it, and how many were accepted
    num_accepted_tokens: int = 0
    stop_reason: int | str | None = None
    sample_index: int = 0  # which of the request's n samples this is (``parallel``)
    error: str | None = None
    scheduled_time: float | None = None  # first admitted to a batch (or blocks reserved)
    first_token_time: float | None = None
    # Hashes of the full blocks of all_token_ids computed so far (extended incrementally).
    block_hashes: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        # A decoding request has exactly one: the token sampled last step, not yet fed back.
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def num_kv_tokens_to_import(self) -> int:
        """Decode role: tokens whose KV a pull brings (the prompt's; a migrated request's, all
        but its last token, whose KV its next step computes)."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_prompt_tokens

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend the hash chain to every full block of the known tokens; returns all hashes."""
        num_full = self.num_tokens // block_size
        if len(self.block_hashes) < num_full:
            parent = self.block_hashes[-1] if self.block_hashes else NONE_HASH
            tokens = self.all_token_ids[: num_full * block_size]
            self.block_hashes.extend(
                hash_block_tokens(tokens, block_size, parent, start_block=len(self.block_hashes))
            )
        return self.block_hashes
