"""P1's client-side metric code against a fake gRPC server with injected delays.

The fake server waits a scripted delay before the first chunk and between chunks, and records
when it really sent each one; the client's TTFT, ITL, TPOT and E2EL must match the metrics
computed from those send times (same clock, same process). Loopback delivery is the only gap,
and on a busy 2-core machine it is sometimes a few ms: the median error must stay under 1 ms,
3 values in 4 under 3 ms and every value under 25 ms, and a client timestamp never precedes the
server's send time (TTFT and E2EL err only upwards). One late chunk moves up to five values of
one request (its ITLs, TPOT, E2EL); a wrong metric moves a whole kind of value in every request,
in every run (chunks stamped 4 ms late: every TTFT and E2EL, 8 of the 26; checked by hand).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import grpc
import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.planner.measure.load import compute_metrics, run_load
from cluster.planner.workload import WorkItem

pytestmark = pytest.mark.timeout(60)


class FakeGeneration(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.sent: dict[int, list[float]] = {}

    async def Generate(self, request: pb.GenerateRequest, context: Any):
        n_in = len(request.token_ids.ids)
        n_out = request.sampling.max_tokens
        ttft_delay = 0.02 + 0.001 * n_in  # prefill cost grows with the prompt
        itl_delay = 0.005 + 0.001 * (n_in % 7)
        times = self.sent.setdefault(n_in, [])
        await asyncio.sleep(ttft_delay)
        for i in range(n_out):
            if i:
                await asyncio.sleep(itl_delay)
            times.append(time.perf_counter())
            yield pb.GenerateResponse(token_ids=[i], text="x")


def _load_against(
    servicer: pb_grpc.GenerationServicer,
    items: list[WorkItem],
    offsets: list[float],
    **kwargs: Any,
) -> tuple[Any, float]:
    """``run_load`` against ``servicer`` on a loopback gRPC server of its own."""

    async def main() -> tuple[Any, float]:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run_load(f"127.0.0.1:{port}", items, offsets, **kwargs)
        finally:
            await server.stop(None)

    return asyncio.run(main())


def _run_once(items: list[WorkItem]) -> tuple[Any, float, FakeGeneration]:
    fake = FakeGeneration()
    records, duration = _load_against(fake, items, [0.0, 0.01, 0.02, 0.03])
    return records, duration, fake


def _errors(records: Any, fake: FakeGeneration) -> list[float]:
    """|client metric - the same metric from the server's send times|, every metric."""
    errors = []
    for rec in records:
        truth = fake.sent[rec.prompt_len]
        assert rec.ok and rec.output_tokens == len(truth)
        # the client sees a chunk after the server sent it: TTFT and E2EL err only upwards
        assert rec.ttft >= truth[0] - rec.send - 1e-4
        assert rec.e2el >= truth[-1] - rec.send - 1e-4
        errors.append(abs(rec.ttft - (truth[0] - rec.send)))
        errors.append(abs(rec.e2el - (truth[-1] - rec.send)))
        want_itls = [b - a for a, b in itertools.pairwise(truth)]
        assert len(rec.itls) == len(want_itls)
        errors += [abs(got - want) for got, want in zip(rec.itls, want_itls, strict=True)]
        if rec.output_tokens > 1:
            want_tpot = (truth[-1] - truth[0]) / (len(truth) - 1)
            assert rec.tpot is not None
            errors.append(abs(rec.tpot - want_tpot))
        # and the schedule itself: TTFT at least the injected prefill delay
        assert rec.ttft >= 0.02 + 0.001 * rec.prompt_len - 1e-3
    return errors


def _acceptable(errors: list[float]) -> bool:
    ordered = sorted(errors)
    median = ordered[len(ordered) // 2]
    p75 = ordered[int(0.75 * (len(ordered) - 1))]
    return median < 1e-3 and p75 < 3e-3 and ordered[-1] < 25e-3


ITEMS = ((10, 6), (15, 4), (40, 8), (3, 1))  # (prompt length, output tokens)


def test_client_metrics_match_the_injected_schedule() -> None:
    items = [WorkItem(list(range(n)), k) for n, k in ITEMS]
    # A run disturbed by the machine (a scheduler hiccup longer than the bounds) is repeated, at
    # most 5 times; a wrong metric (an off-by-one chunk, the wrong start time) misses every run.
    worst: list[float] = []
    for _attempt in range(5):
        records, duration, fake = _run_once(items)
        errors = _errors(records, fake)
        if _acceptable(errors):
            break
        worst = sorted(errors)[-8:]
    else:
        raise AssertionError(f"5 runs each missed the bounds; the last run's worst: {worst}")
    m = compute_metrics(records, duration, ttft_slo_s=0.05, tpot_slo_s=0.02)
    assert m["completed"] == 4 and m["failed"] == 0
    # The schedule puts TTFT at 23, 30 and 35 ms (prompts of 3, 10, 15: within the 50 ms SLO) and
    # 60 ms (prompt of 40: a miss, since a sleep never ends early), so an undisturbed run attains
    # 0.75. A late wake-up on the busy machine can push one of the first three past 50 ms too:
    # that is a real miss, so attainment is checked against what each request measured
    # (docs/benchmarks: a request is good when TTFT <= its bound and TPOT, if any, <= its bound).
    by_len = {rec.prompt_len: rec for rec in records}
    assert by_len[40].ttft > 0.05
    good = sum(1 for r in records if r.ttft <= 0.05 and (r.tpot is None or r.tpot <= 0.02))
    assert m["slo_attainment"] == pytest.approx(good / 4)
    assert m["itl_s"]["n"] == sum(k - 1 for _, k in ITEMS)


class SlowStarts(pb_grpc.GenerationServicer):
    """Each request's first token after a delay set by its prompt length (ms), then one token
    every 5 ms; a prompt of length 1 is refused. Records when each request arrived and when it
    sent each token."""

    def __init__(self) -> None:
        self.arrived: dict[int, float] = {}
        self.sent: dict[int, list[float]] = {}

    async def Generate(self, request: pb.GenerateRequest, context: Any):
        n_in = len(request.token_ids.ids)
        self.arrived[n_in] = time.perf_counter()
        if n_in == 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        await asyncio.sleep(n_in / 1000)
        for i in range(request.sampling.max_tokens):
            if i:
                await asyncio.sleep(0.005)
            self.sent.setdefault(n_in, []).append(time.perf_counter())
            yield pb.GenerateResponse(token_ids=[i], text="x")


def test_the_gated_last_request_waits_until_every_other_one_streams_enough_tokens() -> None:
    # The burst calibration's long prompt is sent once all the shorts decode: not on a clock.
    items = [WorkItem([0] * n, k) for n, k in ((20, 10), (120, 10), (1, 5), (60, 2), (30, 3))]
    fake = SlowStarts()
    records, _ = _load_against(fake, items, [0.0] * 5, last_after_tokens=4)
    assert [r.ok for r in records] == [True, True, False, True, True]
    # Released by the slowest request's 4th token (120 ms + 3 x 5 ms), not before; a refused
    # one and one that ended with 2 tokens do not hold it.
    assert fake.arrived[30] >= fake.sent[120][3]
    assert fake.arrived[30] - fake.arrived[120] >= 0.12
    assert records[-1].output_tokens == 3
