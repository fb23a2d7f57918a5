"""The planner's simulator: the engine's own scheduling in simulated time, every request served,
every simulated pool clean at the end, and the timing it derives from the profile."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from cluster.config import ClusterConfig
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.planner.plan import arms_for, simulate, simulate_unloaded
from cluster.planner.profile import Profile
from cluster.planner.simulator import ArmSpec, SimCluster
from cluster.planner.workload import MIXED_LONG, RequestClass, WorkItem, WorkloadMix
from tests.helpers import fake_config, greedy
from tests.unit.planner.synthetic import synthetic_profile

PROFILE = synthetic_profile()


def _prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 37 + i * 11) % 500 for i in range(n)]


def test_a_simulated_replica_schedules_exactly_as_the_engine() -> None:
    """Same requests, same config: the simulated steps are the engine's steps, batch by batch
    (chunked prefill, the token budget, max_num_seqs, preemption under a small pool)."""
    cfg = fake_config(**{"cache.num_blocks": 16, "scheduler.max_num_seqs": 4})
    prompts = {f"r{i}": (_prompt(20 + 9 * i, i), 30 + 11 * i) for i in range(7)}

    engine = LLMEngine(cfg, role="colocated")
    real: list[list[tuple[str, int]]] = []
    schedule = engine.schedule

    def traced() -> object:
        batch = schedule()
        real.append([(it.request.request_id, it.num_new_tokens) for it in batch.items])
        return batch

    engine.schedule = traced  # type: ignore[method-assign]
    first, *rest = prompts.items()
    engine.add(EngineRequest(first[0], first[1][0], greedy(first[1][1])))
    engine.step()  # the simulator's replica starts as soon as the first request lands
    for rid, (p, n) in rest:
        engine.add(EngineRequest(rid, p, greedy(n)))
    while engine.has_unfinished_requests():
        engine.step()
    real = [b for b in real if b]
    assert engine.scheduler.num_preemptions > 0, "the pool should be under pressure"

    arm = ArmSpec("colocated", 0, 1, cfg.replace({"decode.scheduler": None}))
    sim = SimCluster(arm, synthetic_profile(0.0, 0.0))
    sim.decodes[0].trace = []
    items = [WorkItem(p, n, "c") for p, n in prompts.values()]
    records = sim.run(items, [0.0] * len(items))
    assert sim.decodes[0].trace == real
    assert all(r.ok for r in records)


@pytest.mark.parametrize("split", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("stream", [0, 256])
def test_every_remote_request_finishes_and_every_pool_ends_clean(
    split: tuple[int, int], stream: int
) -> None:
    x, y = split
    cfg = ClusterConfig().replace(
        {
            "cache.num_blocks": 300,
            "decode.local_prefill_threshold": 0,
            "transfer.stream_min_tokens": stream,
            "model.num_threads": 1,
        }
    )
    sim = SimCluster(ArmSpec("x", x, y, cfg), PROFILE)
    items = MIXED_LONG.items(40, 49152, seed=3)
    records = sim.run(items, [0.2 * i for i in range(40)])
    assert all(r.ok and len(r.token_times) == r.max_tokens for r in records)
    for e in [*sim.decodes, *sim.prefills]:
        e.check_integrity()
        assert e.block_manager.num_used_blocks == 0, e.name
        assert not list(e.scheduler.requests()) and not list(e.handoff.requests())


def test_unloaded_ttft_is_the_hops_plus_the_profiled_prefill() -> None:
    work = WorkloadMix("one", (RequestClass("c", 1.0, (500, 500), 8),))
    items = work.items(1, 49152, seed=1)
    costs = PROFILE.costs(1)
    for arm in arms_for(2, PROFILE, 700):
        (rec,) = simulate_unloaded(arm, PROFILE, items)
        kind = "local" if arm.colocated else "remote"
        hops = PROFILE.serving_cost(kind).ttft_overhead_s
        if arm.name == "colocated":  # no chunking: one step of 500 tokens
            assert rec.ttft == pytest.approx(hops + costs.step([(500, 0)], []))
        if arm.name == "1P1D":  # chunks of 256 on the prefill replica
            prefill = costs.step([(256, 0)], []) + costs.step([(244, 256)], [])
            assert rec.ttft == pytest.approx(hops + prefill)


def test_the_transfer_delays_the_second_token_and_streaming_leaves_only_the_tail() -> None:
    work = WorkloadMix("long", (RequestClass("c", 1.0, (2048, 2048), 4),))
    items = work.items(1, 49152, seed=1)
    gaps = {}
    for stream in (0, 1024):
        cfg = ClusterConfig().replace(
            {
                "cache.num_blocks": 400,
                "decode.local_prefill_threshold": 0,
                "transfer.stream_min_tokens": stream,
                "model.num_threads": 1,
            }
        )
        (rec,) = simulate_unloaded(ArmSpec("1P1D", 1, 1, cfg, "zmq"), PROFILE, items)
        gaps[stream] = rec.token_times[1] - rec.token_times[0]
    bulk = PROFILE.transfer_cost("zmq").seconds(128 * PROFILE.bytes_per_block)
    tail = PROFILE.transfer_cost("zmq").seconds(16 * PROFILE.bytes_per_block)
    step = PROFILE.costs(1).decode(1, 2049)
    # The first token leaves the decode replica when it arrives there, the pull starts then.
    assert gaps[0] == pytest.approx(bulk + step, rel=0.02)
    assert gaps[1024] == pytest.approx(tail + step, rel=0.02)


def test_the_same_seeds_give_the_same_predictions() -> None:
    arm = arms_for(2, PROFILE, 700)[0]
    a, da = simulate(arm, PROFILE, MIXED_LONG, 0.5, 30, 100, 49152)
    b, db = simulate(arm, PROFILE, MIXED_LONG, 0.5, 30, 100, 49152)
    assert da == db and [r.token_times for r in a] == [r.token_times for r in b]


def _with_stream_cost(stream_s: float) -> Profile:
    serving = {k: dataclasses.replace(v, stream_s=stream_s) for k, v in PROFILE.serving.items()}
    return dataclasses.replace(PROFILE, serving=serving)


def test_each_concurrent_stream_adds_its_cost_to_a_streaming_step_only() -> None:
    """``stream_s`` (the stack's work per streamed token, from a burst) lengthens a colocated or
    decode step by that much per token it streams beyond the first; a prefill replica streams
    nothing to clients, so its steps keep their cost."""
    arms = {a.name: a for a in arms_for(2, PROFILE, 700)}

    def steps(
        name: str, stream_s: float, n: int = 4, prompt: int = 64
    ) -> tuple[list[float], list[int], list[float]]:
        work = WorkloadMix("short", (RequestClass("c", 1.0, (prompt, prompt), 12),))
        items = work.items(n, 49152, seed=3)
        recs = SimCluster(arms[name], _with_stream_cost(stream_s)).run(items, [0.0] * n)
        assert all(r.ok for r in recs)
        times = sorted({t for r in recs for t in r.token_times})
        streams = [sum(t in r.token_times for r in recs) for t in times]
        return times, streams, sorted(r.token_times[0] for r in recs)

    # One colocated replica: the same steps in the same order (all arrive at once), each
    # longer by stream_s for every token it streamed beyond the first.
    t0, n0, _ = steps("colocated_1x2", 0.0)
    t1, n1, _ = steps("colocated_1x2", 0.005)
    assert n0 == n1 and max(n0) == 4
    for i in range(1, len(t0)):
        grew = (t1[i] - t1[i - 1]) - (t0[i] - t0[i - 1])
        assert grew == pytest.approx(0.005 * (n1[i] - 1), abs=1e-9), i
    # 1P1D: the prefill replica's steps (the first tokens; 8 prompts queue there and share
    # steps) unchanged, the decode steps longer.
    p0, _, first0 = steps("1P1D", 0.0, n=8, prompt=200)
    p1, _, first1 = steps("1P1D", 0.005, n=8, prompt=200)
    assert first1 == first0 and p1[-1] > p0[-1] + 0.005


def test_a_pools_steps_slow_by_its_contention_while_the_other_pool_computes() -> None:
    """1P1D on shared cores: a decode step that starts while the prefill replica computes takes
    ``1 + decode_contention`` times as long, and a prefill step during decodes ``1 +
    prefill_contention``; a request alone (nothing overlaps) is unchanged."""
    arm = {a.name: a for a in arms_for(2, PROFILE, 700)}["1P1D"]

    def profile(c: float) -> Profile:
        serving = {
            k: dataclasses.replace(v, decode_contention=c, prefill_contention=c)
            for k, v in PROFILE.serving.items()
        }
        return dataclasses.replace(PROFILE, serving=serving)

    short = WorkItem(_prompt(64, 1), 40, "short")
    long = WorkItem(_prompt(900, 2), 4, "long")  # arrives while the short one decodes
    runs = {c: SimCluster(arm, profile(c)).run([short, long], [0.0, 0.5]) for c in (0.0, 0.5)}
    (a0, b0), (a1, b1) = runs[0.0], runs[0.5]
    assert a1.token_times[0] == a0.token_times[0]  # its prefill overlapped nothing
    gaps0 = [y - x for x, y in itertools.pairwise(a0.token_times[1:])]
    gaps1 = [y - x for x, y in itertools.pairwise(a1.token_times[1:])]
    assert max(gaps1) == pytest.approx(1.5 * max(gaps0), rel=0.05)  # during the long prefill
    assert min(gaps1) == pytest.approx(min(gaps0), rel=1e-6)  # after it
    # The long prompt's prefill steps ran beside the short one's decodes: about 1.5x.
    assert 1.3 < (b1.token_times[0] - 0.5) / (b0.token_times[0] - 0.5) < 1.5
    alone = SimCluster(arm, profile(0.5)).run([long], [0.0])[0]
    assert alone.token_times == SimCluster(arm, profile(0.0)).run([long], [0.0])[0].token_times
