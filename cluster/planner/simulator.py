"""A discrete-event simulation of a pdserve cluster, on the engine's own scheduling policy.

Each simulated replica runs the engine's real ``Scheduler`` over a real ``BlockManager`` with the
role's real hand-off (``cluster.engine.handoff``: colocated, prefill, decode; a streamed prompt's
``BlockStream`` included): admission, chunked prefill, the token budget, preemption, prefix
caching, KV reservations and held blocks are the engine's own code, not a second copy of its
rules. What is simulated is only time: a step costs what the profile says a batch of that shape
costs (``profile.StepCosts``, plus the stack's cost per token it streams, and more while the
other pool computes on shared cores), a KV pull what the profile's transport costs for its
bytes, and the serving stack's hops a fixed delay (``profile.ServingCost``). Between steps the
replica applies what arrived meanwhile (new requests, KV landed, leases released), as the
engine's step loop does.

A remote request goes as in the cluster (docs/architecture/index.md): router -> the decode replica
with the least work (it reserves the prompt's blocks first) -> then the prefill replica with the
fewest queued prompt tokens -> first token back to the decode replica and on to the client; then the
pull of the blocks it lacks (a streamed prompt: its announced parts while the prefill runs,
the tail after), ``kv_arrived``, and the decode batch. Pulls do not share bandwidth with each
other (one pull per request at a time).

Torch-free: ``cluster.engine.scheduler``, ``block_manager``, ``handoff`` and ``request`` import
no torch (tests/unit/test_torch_free.py checks this package).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.handoff import DecodeHandoff, KVReservation, create_handoff
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import ScheduledBatch, Scheduler
from cluster.planner.profile import Profile, ServingCost, StepCosts
from cluster.planner.workload import WorkItem

_TOKEN = 1  # the id every simulated token carries (EOS is ignored: lengths are pinned)


@dataclass(frozen=True)
class ArmSpec:
    """One cluster layout: ``prefill`` replicas (0: colocated) and ``decode`` replicas."""

    name: str
    prefill: int
    decode: int
    # What every replica runs: each pool's scheduler and torch threads (the profile's step-cost
    # table; a colocated replica is a decode-pool replica), cache.num_blocks per replica, the
    # transfer (stream_min_tokens) and decode (local_prefill_threshold) sections.
    config: ClusterConfig
    transport: str = "shm"

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def devices(self) -> int:
        return self.prefill + self.decode


@dataclass
class SimRecord:
    cls: str
    prompt_len: int
    max_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)  # at the client

    @property
    def ok(self) -> bool:
        return len(self.token_times) >= self.max_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return None if n <= 1 else (self.token_times[-1] - self.token_times[0]) / (n - 1)


class Clock:
    """The event queue: ``at(t, fn)`` runs ``fn()`` at simulated time ``t``, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(t, self.now), next(self._seq), fn))

    def run(self, max_events: int = 50_000_000) -> None:
        for _ in range(max_events):
            if not self._events:
                return
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        raise RuntimeError("simulation: too many events (a request that never finishes?)")


class SimEngine:
    """One replica's engine in simulated time."""

    def __init__(
        self,
        name: str,
        role: str,
        config: ClusterConfig,
        costs: StepCosts,
        serving: ServingCost,
        clock: Clock,
        on_token: Callable[[SimEngine, Request, float], None],
    ) -> None:
        config = config.for_pool("prefill" if role == "prefill" else "decode")
        cache = config.cache
        if cache.num_blocks is None:
            raise ValueError("simulator: the arm's config needs cache.num_blocks")
        self.name, self.role, self.config = name, role, config
        self.block_manager = BlockManager(
            cache.num_blocks, cache.block_size, cache.enable_prefix_caching
        )
        self.handoff = create_handoff(role, config, self.block_manager)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.handoff)
        self.costs, self.serving, self.clock = costs, serving, clock
        self.on_token = on_token
        self.on_reserved: Callable[[KVReservation, float], None] = lambda res, t: None
        self.on_streamed: Callable[[str, int, float], None] = lambda rid, n, t: None
        # Whether another pool's engine is busy as a step starts (the cluster sets it).
        self.contended: Callable[[], bool] = lambda: False
        # Prefill role, the first token: the held table (None: that token finished it).
        self.on_first: Callable[[Request, list[int] | None, float], None] = lambda r, b, t: None
        self._inbox: list[Callable[[], None]] = []
        self._busy = False
        self.trace: list[list[tuple[str, int]]] | None = None  # a list: each step's batch
        self.num_steps = 0
        self.busy_s = 0.0

    # -- what arrives between steps -----------------------------------------------------------

    def post(self, fn: Callable[[], None]) -> None:
        """Apply ``fn`` before the next step (now, if the engine is idle)."""
        self._inbox.append(fn)
        if not self._busy:
            self._start()

    def add(
        self, req: Request, prefill: str = "local", on_remote: Callable[[], None] | None = None
    ) -> None:
        """Queue ``req`` before the next step; ``on_remote`` runs if its KV is to come from a
        prefill replica (decode role, as the hand-off decides)."""

        def add() -> None:
            if not self.handoff.admit(req, prefill).remote:  # type: ignore[arg-type]
                self.scheduler.add(req)
                return
            if on_remote is not None:
                on_remote()
            for res in self.scheduler.reserve_between_steps():  # as the engine's add does
                self.on_reserved(res, self.clock.now)

        self.post(add)

    @property
    def busy(self) -> bool:
        """A step is running."""
        return self._busy

    @property
    def load(self) -> int:
        """Requests here, queued or running or waiting for KV (the routers' least-work view)."""
        return self.scheduler.num_unfinished + sum(1 for _ in self.handoff.requests())

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.scheduler.requests()
        )

    # -- the step -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._busy:
            return
        inbox, self._inbox = self._inbox, []
        for fn in inbox:
            fn()
        batch = self.scheduler.schedule()
        now = self.clock.now
        for res in batch.reservations:
            self.on_reserved(res, now)
        if batch.is_empty:
            return  # idle until something is posted
        cost = self._cost(batch)
        if self.trace is not None:
            self.trace.append([(it.request.request_id, it.num_new_tokens) for it in batch.items])
        self._busy = True
        self.busy_s += cost
        self.clock.at(now + cost, lambda: self._finish(batch))

    def _cost(self, batch: ScheduledBatch) -> float:
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for item in batch.items:
            req = item.request
            if req.is_prefilling:
                prefill.append((item.num_new_tokens, req.num_computed_tokens))
            else:
                decode.append(req.num_computed_tokens + 1)
        d = self.costs.decode(len(decode), sum(decode) / len(decode)) if decode else 0.0
        p = self.costs.step(prefill, decode) - d
        cost = d * self.serving.decode_scale + p * self.serving.prefill_scale
        if self.role != "prefill":  # its tokens stream to clients (a prefill replica's do not)
            streamed = sum(1 for item in batch.items if item.samples)
            cost += self.serving.stream_s * max(0, streamed - 1)
        if self.contended():  # the other pool's engine computes too, on shared cores
            s = self.serving
            cost *= 1 + (s.prefill_contention if self.role == "prefill" else s.decode_contention)
        return cost

    def _finish(self, batch: ScheduledBatch) -> None:
        now = self.clock.now
        self.num_steps += 1
        sampled = [item.request for item in batch.items if item.samples]  # as the runner says
        for item in batch.items:
            self.scheduler.commit(item)
        for out in self.handoff.take_outputs():  # a streamed prompt's announced blocks
            assert out.streamed_block_ids is not None
            self.on_streamed(out.request_id, len(out.streamed_block_ids), now)
        for req in sampled:
            self.append(req, now)
        self._busy = False
        self._start()

    def append(self, req: Request, now: float) -> None:
        """A token for ``req`` (sampled here, or the prefill replica's first one)."""
        req.output_token_ids.append(_TOKEN)
        self.on_token(self, req, now)
        held = None
        if req.num_output_tokens >= req.params.max_tokens:
            if req.status == RequestStatus.WAITING_FOR_KV:  # the prefill replica's token
                self.handoff.remove(req)
            else:
                self.scheduler.remove(req)
            if self.block_manager.has_table(req.request_id):
                self.block_manager.free(req.request_id)
        elif self.handoff.ends_here(req):
            held = self.handoff.hold(req)
            self.scheduler.remove(req)
        if self.role == "prefill":
            self.on_first(req, held, now)

    def kv_arrived(self, request_id: str) -> None:
        handoff = self.handoff
        assert isinstance(handoff, DecodeHandoff)
        self.post(lambda: self.scheduler.add(handoff.kv_arrived(request_id)))

    def release(self, request_id: str) -> None:
        def release() -> None:
            self.handoff.release(request_id)

        self.post(release)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()


@dataclass
class _Remote:
    """A remote request's hand-off state on its decode replica."""

    req: Request
    decode: SimEngine
    prefill: SimEngine | None = None  # chosen once the decode replica reserved the blocks
    reserved_at: float | None = None
    num_hit_blocks: int = 0
    announced: int = 0  # blocks the prefill side has leased so far (streamed)
    pulled: int = 0  # leading blocks here: cached, or pulled
    pull_busy_until: float = 0.0
    reply_at: float | None = None  # the first token reached the decode replica
    num_blocks: int = 0  # the whole prompt's, once the reply names them
    done: bool = False


class SimCluster:
    """One arm under one arrival sequence; ``run`` returns a record per request."""

    def __init__(self, arm: ArmSpec, profile: Profile) -> None:
        self.arm, self.profile = arm, profile
        self.clock = Clock()
        kind = "local" if arm.colocated else "remote"
        self.serving = profile.serving_cost(kind)
        self.transfer = None if arm.colocated else profile.transfer_cost(arm.transport)
        self.records: dict[str, SimRecord] = {}
        self._remote: dict[str, _Remote] = {}
        cfg = arm.config

        def engine(name: str, role: str) -> SimEngine:
            pool = cfg.prefill if role == "prefill" else cfg.decode
            threads = pool.num_threads or cfg.model.num_threads or 1
            costs = profile.costs(threads, cfg.for_pool(role).model.tensor_parallel_size)
            return SimEngine(name, role, cfg, costs, self.serving, self.clock, self._token)

        if arm.colocated:
            self.decodes = [engine(f"c{i}", "colocated") for i in range(arm.decode)]
            self.prefills: list[SimEngine] = []
        else:
            self.decodes = [engine(f"d{i}", "decode") for i in range(arm.decode)]
            self.prefills = [engine(f"p{i}", "prefill") for i in range(arm.prefill)]
        for d in self.decodes:
            d.on_reserved = self._reserved
            d.contended = lambda: any(p.busy for p in self.prefills)
        for p in self.prefills:
            p.on_streamed = self._streamed
            p.on_first = self._first
            p.contended = lambda: any(d.busy for d in self.decodes)
        # The serving stack's delay, split evenly over its hops: in and out for a colocated
        # request; in, to the prefill pool, back, and out for a remote one.
        hops = 2 if arm.colocated else 4
        self.hop_s = self.serving.ttft_overhead_s / hops

    # -- requests -----------------------------------------------------------------------------

    def run(self, items: Sequence[WorkItem], offsets: Sequence[float]) -> list[SimRecord]:
        for i, (item, t0) in enumerate(zip(items, offsets)):
            rid = f"r{i}"
            self.records[rid] = SimRecord(item.cls, len(item.token_ids), item.max_tokens, t0)
            self.clock.at(t0 + self.hop_s, partial(self._arrive, rid, item))
        self.clock.run()
        for e in [*self.decodes, *self.prefills]:
            e.check_integrity()
        return [self.records[f"r{i}"] for i in range(len(items))]

    def _arrive(self, rid: str, item: WorkItem) -> None:
        params = SamplingParams(
            max_tokens=item.max_tokens, min_tokens=item.max_tokens, ignore_eos=True
        )
        decode = min(self.decodes, key=lambda e: e.load)
        req = Request(rid, list(item.token_ids), params, seed=0, arrival_time=self.clock.now)
        if self.arm.colocated:
            decode.add(req)
            return

        def remote() -> None:  # the decode replica keeps it waiting for KV (and its blocks)
            self._remote[rid] = _Remote(req, decode)

        decode.add(req, "auto", on_remote=remote)

    def _token(self, engine: SimEngine, req: Request, now: float) -> None:
        if engine.role == "prefill":
            return  # its first token reaches the client through the decode replica
        self.records[req.request_id].token_times.append(now + self.hop_s)

    # -- the remote hand-off --------------------------------------------------------------------

    def _reserved(self, res: KVReservation, now: float) -> None:
        st = self._remote[res.request_id]
        st.reserved_at = now
        st.num_hit_blocks = res.num_hit_blocks  # cached here: never pulled
        st.pulled = max(st.pulled, res.num_hit_blocks)
        # Blocks reserved: now the prefill pool is called (the decode replica reserves first).
        # The prefill replica computes a request of its own (same prompt, same params).
        prefill = st.prefill = min(self.prefills, key=lambda e: e.queued_prompt_tokens)
        copy = Request(res.request_id, list(st.req.prompt_token_ids), st.req.params, seed=0)
        self.clock.at(now + self.hop_s, lambda: prefill.add(copy))
        self._pull(st)

    def _streamed(self, rid: str, num_blocks: int, now: float) -> None:
        st = self._remote[rid]
        self.clock.at(now + self.hop_s, lambda: self._announce(st, num_blocks))

    def _announce(self, st: _Remote, num_blocks: int) -> None:
        st.announced = max(st.announced, num_blocks)
        self._pull(st)

    def _first(self, req: Request, held: list[int] | None, now: float) -> None:
        st = self._remote[req.request_id]

        def reply() -> None:  # the first token reaches the decode replica
            at = st.reply_at = self.clock.now

            def take() -> None:  # between steps; it streamed on at once (its text came with it)
                st.decode.append(st.req, at if held is not None else self.clock.now)

            st.decode.post(take)
            if held is None:  # it finished there: nothing to pull (a lease's pins go)
                st.done = True
                assert st.prefill is not None
                st.prefill.release(req.request_id)
                return
            st.num_blocks = st.announced = len(held)
            self._pull(st)

        self.clock.at(now + self.hop_s, reply)

    def _pull(self, st: _Remote) -> None:
        """Start the next pull if one can start now: blocks announced, reserved, none in flight."""
        now = self.clock.now
        if st.done or st.reserved_at is None or st.pull_busy_until > now:
            return
        final = st.reply_at is not None
        todo = st.announced - st.pulled
        if todo <= 0 and not final:
            return
        assert self.transfer is not None
        seconds = self.transfer.seconds(max(0, todo) * self.profile.bytes_per_block) if todo else 0
        st.pull_busy_until = now + seconds
        st.pulled = max(st.pulled, st.announced)

        def landed() -> None:
            if st.reply_at is not None and st.pulled >= st.num_blocks:
                st.done = True
                assert st.prefill is not None
                st.prefill.release(st.req.request_id)
                rid = st.req.request_id
                self.clock.at(
                    self.clock.now + self.serving.handoff_s, lambda: st.decode.kv_arrived(rid)
                )
            else:
                self._pull(st)  # the next part, if more was announced meanwhile

        self.clock.at(now + seconds, landed)

    # -- introspection --------------------------------------------------------------------------

    def utilization(self) -> dict[str, Any]:
        end = max(self.clock.now, 1e-9)
        return {e.name: e.busy_s / end for e in [*self.decodes, *self.prefills]}
