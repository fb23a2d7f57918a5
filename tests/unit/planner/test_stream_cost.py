"""``stream_cost``: the serving calibration's cost per concurrent stream, from a burst."""

from __future__ import annotations

import pytest

from cluster.bench.profile import BurstSample, stream_cost
from tests.unit.planner.synthetic import costs

STEPS = costs(1.0)


def _burst(
    k: int, per_token: float, *, lag: float = 0.05, merged: bool = False
) -> list[BurstSample]:
    """k requests of 64 + 24 tokens: first tokens ``lag`` apart (their prefills, one at a time),
    then all decode together, one token per ``per_token``; ``merged``: every other chunk
    carries two tokens (a client that fell behind gets chunks merged)."""
    out = []
    for i in range(k):
        first = 0.1 + i * lag
        start = 0.1 + k * lag  # every one decodes from here
        times = [first] + [start + j * per_token for j in range(23)]
        tokens = [1] * 24
        if merged:
            times = times[:1] + times[2::2]
            tokens = [1] + [2] * (len(times) - 1)
        out.append(BurstSample(64, 24, times, tokens))
    return out


@pytest.mark.parametrize("merged", [False, True])
def test_the_per_stream_cost_is_what_the_steps_gain_over_the_engine(merged: bool) -> None:
    k, scale, extra = 8, 1.3, 0.004
    engine = STEPS.decode(k, 64 + 12) * scale
    got, raw = stream_cost(_burst(k, engine + extra * (k - 1), merged=merged), STEPS, scale)
    assert got == pytest.approx(extra, rel=1e-6)
    assert raw["streams"] == k and len(raw["per_token_s"]) == k


def test_no_burst_or_a_faster_one_than_the_engine_costs_nothing() -> None:
    assert stream_cost([], STEPS, 1.0)[0] == 0.0
    assert stream_cost(_burst(1, 0.05), STEPS, 1.0)[0] == 0.0  # one stream: nothing to fit
    fast = STEPS.decode(4, 76) * 0.5  # noise below the engine's own step is no negative cost
    assert stream_cost(_burst(4, fast), STEPS, 1.0)[0] == 0.0
