"""Parallel sampling (``n > 1``): n samples of one prompt on the prompt's shared KV blocks.

A request with n samples is n engine requests. The leader keeps the caller's id and seed and
goes wherever its prompt goes (prefilled here, or its KV pulled from a prefill replica: one
prefill and one transfer for all n). Samples 1..n-1 (ids ``rid#i``, seeds ``sample_seed(seed,
i)``) wait here (``WAITING_FOR_LEADER``) until the leader's prompt KV is computed, then are forked
from it: a sample's block table starts with the leader's prompt blocks, shared by reference
count (as prefix-cache hits are). What copy-on-write would do, by the prompt's last block:

* **Full** (``P % block_size == 0``): every prompt block is shared and nothing is copied, since
  each sample's output starts in a new block. The samples' first tokens are drawn from the
  leader's last-position logits, in the leader's step (``ScheduledRequest.fanout``, sampled
  by ``spec.verify``), each with its own seed; forked with all P tokens computed, a sample
  then only decodes. In PD the prefill replica does the same draw (``n`` in the prefill call;
  its engine's samples end with their first token: ``PrefillHandoff.hold``) and ships the
  n - 1 tokens in its reply; the decode replica streams them from the reply and hands them to
  its engine with the leader's (``kv_arrived``, or ``kv_failed`` to recompute). Chosen over
  recomputing the last position on the decode side without writing its KV: that needs a
  no-write path in every runner and attention kernel, and the decode side's logits would come
  from another kernel than the prefill replica's, which a separate request's first token
  comes from.
* **Partial**: the samples share the leader's first ``(P - 1) // block_size`` blocks and each
  recomputes the rest of the prompt (1 to ``block_size - 1`` tokens) into a block of its own,
  then draws its first token from its own row. That costs one own block per sample, exactly
  what copying the partial block would, with no KV copy kernel in the runners; the price is
  up to ``block_size - 1`` prompt tokens computed per extra sample.

Either way sample i is token for token a separate request with seed ``sample_seed(seed, i)``:
its first token comes from the logits of the same prompt, drawn with its own seed.

A leader that ends before its KV is computed (its first token stopped it, or the KV never came)
leaves its samples to prefill on their own (the prefix cache may still serve them); one whose
samples already have their first tokens recomputes them the way a preempted request would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from cluster.common.sampling_params import MAX_SAMPLES
from cluster.engine.batch import ScheduledRequest
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampler import draw_seed

_SEED_STREAM = 1 << 62  # sample i's seed is drawn at output index 2**62 + i of the request seed


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's n samples (the first is the request's own)."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed: the request's own for sample 0, a derived stream for the rest."""
    return seed if index == 0 else draw_seed(seed, _SEED_STREAM + index)


def check_n(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"n: must be an integer in [1, {MAX_SAMPLES}], got {n!r}")
    return n


class SampleGroups:
    """The samples of each ``n > 1`` request: which wait for their leader's KV, which live."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self._pending: dict[str, list[Request]] = {}  # leader id -> samples awaiting its KV
        self._live: dict[str, set[str]] = {}  # leader id -> ids of its samples still here
        self._leader: dict[str, str] = {}  # sample id -> leader id

    def add(self, leader: Request, n: int) -> list[Request]:
        """Samples 1..n-1 of ``leader`` (kept here until its prompt KV is computed)."""
        if n == 1:
            return []
        rid = leader.request_id
        samples = [
            Request(
                sid,
                leader.prompt_token_ids,
                leader.params,
                sample_seed(leader.seed, i),
                leader.eos_token_ids,
                arrival_time=leader.arrival_time,
                status=RequestStatus.WAITING_FOR_LEADER,
                sample_index=i,
            )
            for i, sid in enumerate(sample_ids(rid, n)[1:], start=1)
        ]
        self._pending[rid] = samples
        self._live[rid] = {rid, *(s.request_id for s in samples)}
        self._leader.update((sid, rid) for sid in self._live[rid])
        return samples

    def release(self, requests: Mapping[str, Request]) -> list[Request]:
        """Samples whose leader's prompt KV is computed, forked from it (or whose leader is
        gone, unshared): the scheduler's from now on."""
        out: list[Request] = []
        for rid, samples in list(self._pending.items()):
            leader = requests.get(rid)
            if leader is not None and not self._kv_ready(leader):
                continue
            del self._pending[rid]
            for s in samples:
                if leader is not None:
                    self._fork(leader, s)
                out.append(s)
        return out

    def fan_out(self, items: Iterable[ScheduledRequest]) -> None:
        """Give each leader's step that draws its first token from a full last prompt block
        its samples to draw theirs from the same row (``ScheduledRequest.fanout``)."""
        for it in items:
            leader = it.request
            samples = self._pending.get(leader.request_id)
            if samples and self._full(leader) and it.samples and not leader.output_token_ids:
                it.fanout = [s for s in samples if not s.output_token_ids]

    def _full(self, req: Request) -> bool:
        return req.num_prompt_tokens % self.block_size == 0

    def _shared_blocks(self, leader: Request, sample: Request) -> int:
        """All the prompt's blocks for a sample with its first token (a full last block), else
        the full ones before the block its tail is recomputed into."""
        if sample.output_token_ids:
            return leader.num_prompt_tokens // self.block_size
        return (leader.num_prompt_tokens - 1) // self.block_size

    def _kv_ready(self, leader: Request) -> bool:
        bm = self.block_manager
        p = leader.num_prompt_tokens
        needed = p if self._full(leader) else (p - 1) // self.block_size * self.block_size
        return (
            leader.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
            and bm.has_table(leader.request_id)
            and leader.num_computed_tokens >= needed
        )

    def _fork(self, leader: Request, sample: Request) -> None:
        h = self._shared_blocks(leader, sample)
        if h == 0:
            return  # a prompt within one block: nothing whole to share
        shared = self.block_manager.block_table(leader.request_id)[:h]
        self.block_manager.allocate(sample.request_id, 0, shared)
        sample.num_computed_tokens = sample.num_cached_tokens = h * self.block_size

    def remove(self, req: Request) -> None:
        """Take out a sample still waiting for its leader's KV (``WAITING_FOR_LEADER``: it
        finished with a first token from elsewhere, or was aborted)."""
        self._pending[self._leader[req.request_id]].remove(req)

    def samples(self, request_id: str) -> list[str]:
        """The ids of a request's samples still in the engine (``[request_id]`` for n = 1)."""
        rid = self._leader.get(request_id, request_id)
        return sorted(self._live.get(rid, {request_id}))

    def forget(self, request_id: str) -> None:
        rid = self._leader.pop(request_id, None)
        if rid is None:
            return
        live = self._live[rid]
        live.discard(request_id)
        if not live:
            del self._live[rid]
            self._pending.pop(rid, None)

    def requests(self) -> Iterable[Request]:
        for samples in self._pending.values():
            yield from samples

    def stats(self) -> dict[str, int]:
        return {"num_samples_waiting": sum(len(s) for s in self._pending.values())}
