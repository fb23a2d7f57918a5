"""Messages between the pools (router -> decode -> prefill), torch-free.

They ride on Ray Serve's handles, Ray's internal plane (Ray's token auth, network policy), never
on pdserve's KV sockets. Frozen dataclasses with typed fields (a KV handle is a
``KVTransferParams``, a layout a ``KVLayout``): Ray serializes the objects themselves, once, at
the boundary, and every role reads them back as these types, never as dicts. A changed copy is
``dataclasses.replace``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cluster.common.kv_layout import KVLayout
from cluster.common.kv_params import KVTransferParams
from cluster.common.sampling_params import SamplingParams

PHASES = (
    "router_queue_ms",
    "decode_queue_ms",
    "prefill_queue_ms",
    "prefill_ms",
    "transfer_ms",
    "decode_ms",
)


@dataclass(frozen=True, slots=True)
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
    resume: ResumeState | None = None  # live migration: take over a request decoding elsewhere

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()


@dataclass(frozen=True, slots=True)
class PrefillCall:
    """Decode replica -> prefill replica: compute the prompt's KV and the first token."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    seed: int  # the decode side's seed, so both sides sample the same tokens
    kv_layout: KVLayout  # the caller's pool: the prefill replica refuses the call unless equal
    decode_endpoint: str = ""  # who will pull (logging, affinity)
    deadline: float | None = None
    exclude_replicas: tuple[str, ...] = ()  # replicas that failed this request already
    n: int = 1  # samples: with a full last block the reply has 1..n-1's first tokens (parallel)


@dataclass(frozen=True, slots=True)
class Accepted:
    """The first item of every pool stream: which replica took the call (retries exclude it)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """Prefill replica -> decode replica, while a streamed prompt prefills: its lease so far."""

    request_id: str
    kv: KVTransferParams  # every full block computed to date


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One sample's first token as the prefill replica's engine produced it: the one source of
    what the client gets for it (the decode replica streams it as is) and of what the decode
    engine takes in (``kv_arrived``), so both stay what a single engine would have made."""

    token_id: int
    # Its text as an engine hands it out: held back while it may start a stop string, all of it
    # (up to a matched stop string) when the token ends the sample.
    text: str
    logprob: float | None = None  # set when the call asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (with logprob) the top k
    finish_reason: str | None = None  # set when the token ends its sample ("stop" | "length")


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """Prefill replica -> decode replica, as soon as prefill is done."""

    request_id: str
    # Sample 0's first token, then (PrefillCall.n > 1 and a prompt that fills its last block:
    # the samples share every prompt block) samples 1..n-1's, in sample order.
    first_tokens: tuple[FirstToken, ...]
    kv: KVTransferParams | None  # None: nothing to pull (the first token ended the request)
    num_cached_tokens: int  # the prefill replica's own prefix-cache hit
    prefill_queue_ms: float
    prefill_ms: float

    def __post_init__(self) -> None:
        if not self.first_tokens:
            raise ValueError("first_tokens: a prefill reply carries at least sample 0's")

    @property
    def first(self) -> FirstToken:
        """Sample 0's first token."""
        return self.first_tokens[0]


@dataclass(frozen=True, slots=True)
class ResumeState:
    """A decoding request leaving a drained decode replica (live migration): what the decode
    replica that takes it over needs, sent in a ``GenerateCall`` by the router. ``kv`` leases
    the KV of the prompt and of every output token but the last on the source replica; the
    sampling state is the seed and the tokens the client has (sampling is keyed by seed and
    output index; stop strings, detokenizer and grammar are replayed from the tokens) plus the
    speculation's history; the rest carries the usage figures so far."""

    source_replica: str  # the replica it leaves (excluded from the call)
    output_token_ids: tuple[int, ...]
    seed: int
    kv: KVTransferParams
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_track: tuple[float, float, int, int] | None = None
    prefill_mode: str = "remote"
    cached_tokens: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_migrations: int = 1

    def __post_init__(self) -> None:
        if not self.output_token_ids:
            raise ValueError("output_token_ids: a migrating request has decoded at least one")


@dataclass(frozen=True, slots=True)
class Migrating:
    """Decode replica -> router: this request leaves the replica (it is being drained); call
    the decode pool with ``resume``. The stream then ends once the new replica pulled the KV,
    or goes on here (its chunks follow) when no replica took it."""

    request_id: str
    resume: ResumeState


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_mode: str = ""  # "remote" | "local"
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # Speculative decoding: drafts verified and accepted (each saved a step); 0, 0 without it.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
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
