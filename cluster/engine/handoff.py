"""What differs between roles: how a request's KV crosses between pools, as one collaborator.

The scheduler stays the plain continuous batcher (waiting, running). Each engine has one hand-off,
chosen by role from ``HANDOFFS``, which the engine calls at three points:

  * admit (``admit``): where a new request goes. ``decode`` keeps a request whose prompt is
    prefilled elsewhere (``WAITING_FOR_KV``, no blocks yet); everything else is the scheduler's.
  * reserve (``reserve``, each step after the running batch, and at admission what the running
    batch's next step leaves free): ``decode`` gives the requests it keeps their blocks (its own
    cached prefix first); the KV is then written into them from outside and ``kv_arrived``
    hands the request to the scheduler, which feeds its first token.
  * finish (``ends_here`` / ``hold``, after each token): ``prefill`` ends a request's part with
    its first token and holds its blocks (not freed, not evictable) until ``release`` (the
    decode side pulled them, or the lease ended).
  * progress (``computed`` after each step's commit, ``take_outputs``): ``prefill`` streams a
    long prompt's finished blocks while later chunks compute (``block_stream``).

``colocated`` (the offline engine, a colocated pool) does none of it. No role flags live on the
request or in the scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.block_stream import BlockStream
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import PrefillMode, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    """Where adding a request decided its prompt's KV comes from, for the caller (no second
    round trip to ask)."""

    num_cached_tokens: int  # prompt tokens this engine's prefix cache holds right now
    remote: bool  # the prompt's KV comes from a prefill replica into reserved blocks


@dataclass(slots=True)
class KVReservation:
    """Decode role: blocks reserved for a request whose prompt KV comes from a prefill replica."""

    request_id: str
    block_ids: list[int]  # the whole table (prefix hits first), room for the first token too
    num_hit_blocks: int  # leading blocks already cached here: they need no transfer


@dataclass(frozen=True, slots=True)
class MigrationExport:
    """Decode role: a running request paused for live migration (``LLMEngine.migrate_out``):
    what another decode replica needs to take it over. ``block_ids`` hold the KV of the first
    ``num_kv_tokens`` tokens (the prompt, then every output token but the last); the sampling
    state is the seed and the output tokens (sampling is keyed by seed and output index; the
    stop-string, detokenizer and grammar state are replayed from the tokens), plus the adaptive
    speculation's acceptance track."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    seed: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # of the full blocks among the first num_kv_tokens
    num_kv_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    spec_track: tuple[float, float, int, int] | None


class Handoff:
    """Colocated: every request is prefilled and decoded by this engine; nothing crosses."""

    def __init__(self, config: ClusterConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size

    def admit(self, req: Request, prefill: PrefillMode) -> PrefillDecision:
        """A new request: ``remote`` means the hand-off keeps it; otherwise it is queued."""
        if prefill == "remote":
            raise ValueError("prefill: remote prefill needs an engine in the decode role")
        return PrefillDecision(self.num_cached_blocks(req) * self.block_size, remote=False)

    def num_samples(self, req: Request, n: int) -> int:
        """How many of a request's n samples this engine runs (``parallel``)."""
        return n

    def reserve(
        self, num_running: int, max_num_seqs: int, keep_free: int = 0
    ) -> list[KVReservation]:
        return []

    def computed(self, req: Request) -> None:
        """After a step computed more of ``req`` (its full blocks are published)."""

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs the hand-off made since the last call (streamed blocks, prefill role)."""
        return []

    def ends_here(self, req: Request) -> bool:
        """After a token that did not finish ``req``: is this engine's part of it over?"""
        return False

    def hold(self, req: Request) -> list[int]:
        raise AssertionError("only the prefill hand-off holds blocks")

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks; False when it holds none for that id."""
        return False

    def remove(self, req: Request) -> None:
        """Hand back a request this hand-off keeps (``WAITING_FOR_KV``: to finish it, or to
        prefill it locally)."""
        raise AssertionError(f"request {req.request_id!r}: this hand-off keeps no requests")

    def is_holding(self, request_id: str) -> bool:
        """Whether blocks of a request that ended here are held under that id."""
        return False

    def requests(self) -> Iterable[Request]:
        return ()

    def stats(self) -> dict[str, int]:
        return {"num_waiting_for_kv": 0, "num_held": 0}

    def num_cached_blocks(self, req: Request) -> int:
        """Leading prompt blocks cached here (tokens compared), keeping one token to compute."""
        max_hit_blocks = (req.num_prompt_tokens - 1) // self.block_size
        hashes = req.update_block_hashes(self.block_size)[:max_hit_blocks]
        return len(self.block_manager.match_prefix(hashes, req.prompt_token_ids))


class PrefillHandoff(Handoff):
    """Prefill role: a request ends here after its first token; its blocks wait for a pull."""

    def __init__(self, config: ClusterConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self.held: set[str] = set()
        self.stream = BlockStream(block_manager, config.transfer.stream_min_tokens)

    def computed(self, req: Request) -> None:
        self.stream.computed(req)

    def take_outputs(self) -> list[RequestOutput]:
        return self.stream.take_outputs()

    def num_samples(self, req: Request, n: int) -> int:
        """The samples' first tokens are drawn here when the prompt fills its last block (they
        share all of it; the reply carries them); otherwise each sample recomputes the prompt's
        tail on the decode replica, and none of them exists here."""
        return n if req.num_prompt_tokens % self.block_size == 0 else 1

    def ends_here(self, req: Request) -> bool:
        return req.num_output_tokens >= 1

    def hold(self, req: Request) -> list[int]:
        if not self.block_manager.has_table(req.request_id):
            return []  # a sample's first token: its KV is its leader's, held under the leader
        self.held.add(req.request_id)
        return self.stream.table(req)  # a streamed prompt: the announced blocks first

    def release(self, request_id: str) -> bool:
        pinned = self.stream.release(request_id)
        if request_id not in self.held:
            return pinned
        self.held.remove(request_id)
        self.block_manager.free(request_id)
        return True

    def is_holding(self, request_id: str) -> bool:
        return request_id in self.held or self.stream.is_pinned(request_id)

    def stats(self) -> dict[str, int]:
        return {
            "num_waiting_for_kv": 0,
            "num_held": len(self.held),
            "num_streaming": self.stream.num_streaming,
        }


class DecodeHandoff(Handoff):
    """Decode role: requests whose prompt KV is pulled from a prefill replica wait here."""

    def __init__(self, config: ClusterConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self.threshold = config.decode.local_prefill_threshold
        self.kv_waiting: deque[Request] = deque()  # no blocks yet
        self.kv_reserved: dict[str, Request] = {}  # blocks reserved, KV in flight
        self.migrating: dict[str, Request] = {}  # paused, leased to another decode replica

    def admit(self, req: Request, prefill: PrefillMode) -> PrefillDecision:
        num_cached = self.num_cached_blocks(req) * self.block_size
        remote = prefill == "remote" or (
            prefill == "auto" and req.num_prompt_tokens - num_cached > self.threshold
        )
        if remote and req.params.prompt_logprobs is not None:  # computed where it prefills
            if prefill == "remote":
                raise ValueError("prompt_logprobs: needs the prompt prefilled here, not remote")
            remote = False
        if remote:
            req.status = RequestStatus.WAITING_FOR_KV
            self.kv_waiting.append(req)
        return PrefillDecision(num_cached, remote)

    def reserve(
        self, num_running: int, max_num_seqs: int, keep_free: int = 0
    ) -> list[KVReservation]:
        """Blocks for waiting requests, oldest first, while seats and blocks (all but
        ``keep_free``) last."""
        out: list[KVReservation] = []
        bm = self.block_manager
        while self.kv_waiting and num_running + len(self.kv_reserved) < max_num_seqs:
            req = self.kv_waiting[0]
            # The imported tokens' blocks (a prompt's; a migrated request's prompt and outputs
            # but the last), those cached here first, and room for the next token's KV: a
            # prompt that fills its last block needs one more block to decode at all, and
            # kv-arrived requests that cannot take a step are not running, so nothing could be
            # preempted to make room.
            num_kv = req.num_kv_tokens_to_import
            hashes = req.update_block_hashes(self.block_size)[: num_kv // self.block_size]
            hits = bm.match_prefix(hashes, req.all_token_ids)
            needed = bm.blocks_needed(num_kv + 1) - len(hits)
            if not bm.can_allocate(needed + keep_free, hits):
                break
            self.kv_waiting.popleft()
            table = bm.allocate(req.request_id, needed, hits)
            req.num_cached_tokens = len(hits) * self.block_size
            self.kv_reserved[req.request_id] = req
            out.append(KVReservation(req.request_id, list(table), len(hits)))
        return out

    def kv_arrived(self, request_id: str) -> Request:
        """The imported KV is in the reserved blocks: publish them; the request may decode."""
        req = self.kv_reserved.pop(request_id)
        req.num_computed_tokens = req.num_kv_tokens_to_import
        self.block_manager.cache_blocks(
            request_id,
            req.update_block_hashes(self.block_size),
            req.all_token_ids,
            req.num_computed_tokens,
        )
        return req

    def migrate(self, req: Request) -> None:
        """Keep a running request (taken off the scheduler) paused while another decode
        replica pulls its KV."""
        req.status = RequestStatus.MIGRATING
        self.migrating[req.request_id] = req

    def remove(self, req: Request) -> None:
        if req.status == RequestStatus.MIGRATING:
            del self.migrating[req.request_id]
        elif self.kv_reserved.pop(req.request_id, None) is None:
            self.kv_waiting.remove(req)  # ValueError: not kept here (a bug in the caller)

    def requests(self) -> Iterable[Request]:
        yield from self.kv_waiting
        yield from self.kv_reserved.values()
        yield from self.migrating.values()

    def stats(self) -> dict[str, int]:
        return {
            "num_waiting_for_kv": len(self.kv_waiting) + len(self.kv_reserved),
            "num_held": 0,
            "num_migrating": len(self.migrating),
        }


HandoffFactory = Callable[[ClusterConfig, BlockManager], Handoff]
HANDOFFS: dict[str, HandoffFactory] = {
    "colocated": Handoff,
    "prefill": PrefillHandoff,
    "decode": DecodeHandoff,
}


def create_handoff(role: str, config: ClusterConfig, block_manager: BlockManager) -> Handoff:
    try:
        factory = HANDOFFS[role]
    except KeyError:
        raise ValueError(
            f"role: unknown engine role {role!r}; valid: {', '.join(HANDOFFS)}"
        ) from None
    return factory(config, block_manager)
