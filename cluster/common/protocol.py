"""Messages between the pools (router -> decode -> prefill), torch-free.

They ride on Ray Serve's handles, Ray's internal plane (Ray's token auth, network policy), never
on pdserve's KV sockets. Plain dataclasses: every role builds and reads them without the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cluster.common.sampling_params import SamplingParams

PHASES = (
    "router_queue_ms",
    "decode_queue_ms",
    "prefill_queue_ms",
    "prefill_ms",
    "transfer_ms",
    "decode_ms",
)


@dataclass(slots=True)
class GenerateCall:
    """Router -> decode replica: a validated, tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[int]  # of the prompt's full blocks (the routers' and pools' address)
    params: SamplingParams
    n: int = 1  # samples of the prompt: chunks carry their index, usage comes once, at the end
    arrival_time: float = field(default_factory=time.time)  # wall clock at the router
    deadline: float | None = None  # wall clock; None: none
    router_queue_ms: float = 0.0
    exclude_replicas: tuple[str, ...] = ()  # replicas that failed this request already

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()


@dataclass(slots=True)
class PrefillCall:
    """Decode replica -> prefill replica: compute the prompt's KV and the first token."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    seed: int  # the decode side's seed, so both sides sample the same tokens
    decode_endpoint: str = ""  # who will pull (logging, affinity)
    deadline: float | None = None
    exclude_replicas: tuple[str, ...] = ()  # replicas that failed this request already
    kv_layout: dict[str, object] | None = None  # the caller's KVLayout: refused unless equal
    n: int = 1  # samples: with a full last block the reply has 1..n-1's first tokens (parallel)


@dataclass(frozen=True, slots=True)
class Accepted:
    """The first item of every pool stream: which replica took the call (retries exclude it)."""

    replica_id: str


@dataclass(slots=True)
class PrefillProgress:
    """Prefill replica -> decode replica, while a streamed prompt prefills: its lease so far."""

    request_id: str
    kv: dict[str, Any]  # KVTransferParams.to_dict(): every full block computed to date


@dataclass(slots=True)
class PrefillReply:
    """Prefill replica -> decode replica, as soon as prefill is done."""

    request_id: str
    first_token_id: int
    first_logprob: float | None
    first_top_logprobs: list[tuple[int, float]] | None
    kv: dict[str, Any] | None  # KVTransferParams.to_dict(); None when nothing is to be pulled
    finish_reason: str | None  # set when the first token already ends the request
    num_cached_tokens: int  # the prefill replica's own prefix-cache hit
    prefill_queue_ms: float
    prefill_ms: float
    sample_first_tokens: list[tuple[int, Any, Any]] = field(default_factory=list)  # PrefillCall.n
    first_text: str | None = None  # its text as a decode engine holds it back (None: ask one)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_mode: str = ""  # "remote" | "local"
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # Speculative decoding: drafts verified and accepted (each saved a step); 0, 0 without it.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(slots=True)
class StreamChunk:
    """Decode replica -> router: what one or more steps produced for a request."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # set on the last chunk
    usage: Usage | None = None  # set on the last chunk
    index: int = 0  # which of the call's n samples (finish_reason: that sample's end)
    prompt_logprobs: list[Any] | None = None  # a sample's first: RequestOutput.prompt_logprobs
