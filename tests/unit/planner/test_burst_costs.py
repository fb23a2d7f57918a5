"""``burst_costs``: the serving calibration's cost per concurrent stream and the pools'
contention, from a burst of short requests and a long prompt sent while they decode."""

from __future__ import annotations

import pytest

from cluster.planner.calibration import BurstSample, burst_costs
from tests.unit.planner.synthetic import costs

STEPS = costs(1.0)
K = 8


def _burst(
    per_token: float,
    *,
    k: int = K,
    slow: tuple[float, float, float] | None = None,
    merged: bool = False,
) -> list[BurstSample]:
    """k requests of 64 + 40 tokens: first tokens 0.05 s apart (their prefills, one at a time),
    then all decode together, one token per ``per_token``, or per ``per_token * factor`` in the
    ``slow`` = (from, to, factor) stretch; ``merged``: every other chunk carries two tokens (a
    client that fell behind gets chunks merged)."""
    out = []
    for i in range(k):
        times, t = [0.1 + i * 0.05], 0.1 + k * 0.05  # every one decodes from t
        for _ in range(39):
            times.append(t)
            t += per_token * (slow[2] if slow and slow[0] <= t < slow[1] else 1.0)
        tokens = [1] * 40
        if merged:
            times = times[:1] + times[2::2]
            tokens = [1] + [2] * (len(times) - 1)
        out.append(BurstSample(64, 40, times, tokens))
    return out


@pytest.mark.parametrize("merged", [False, True])
def test_the_per_stream_cost_is_what_the_steps_gain_over_the_engine(merged: bool) -> None:
    scale, extra = 1.3, 0.004
    engine = STEPS.decode(K, 64 + 20) * scale
    stream_s, contention, raw = burst_costs(
        _burst(engine + extra * (K - 1), merged=merged), None, STEPS, scale
    )
    assert stream_s == pytest.approx(extra, rel=1e-6) and contention == 0.0
    assert raw["streams"] == K and raw["per_token_during_prefill_s"] == []


def test_the_steps_during_the_long_prefill_give_the_contention_not_the_stream_cost() -> None:
    scale, extra = 1.0, 0.002
    per_token = STEPS.decode(K, 64 + 20) * scale + extra * (K - 1)
    # The long prompt prefills from 1.0 to 2.0 s (its first token at 2.0, 1 s of compute),
    # the shorts' steps take 1.5x as long meanwhile.
    shorts = _burst(per_token, slow=(1.0, 2.0, 1.5))
    long = BurstSample(900, 8, [2.0, 2.1], [1, 1], prefill_s=1.0)
    stream_s, contention, raw = burst_costs(shorts, long, STEPS, scale)
    assert stream_s == pytest.approx(extra, rel=1e-6)  # those slow steps left out
    assert contention == pytest.approx(0.5, abs=0.02)
    assert len(raw["per_token_during_prefill_s"]) >= K * 5


def test_no_burst_or_a_faster_one_than_the_engine_costs_nothing() -> None:
    assert burst_costs([], None, STEPS, 1.0)[:2] == (0.0, 0.0)
    assert burst_costs(_burst(0.05, k=1), None, STEPS, 1.0)[:2] == (0.0, 0.0)  # nothing to fit
    fast = STEPS.decode(4, 84) * 0.5  # noise below the engine's own step is no negative cost
    assert burst_costs(_burst(fast, k=4), None, STEPS, 1.0)[:2] == (0.0, 0.0)


def test_calibrate_takes_the_median_over_bursts_that_could_be_fitted() -> None:
    """One burst is one moment of a shared machine: the calibration takes the median over all
    of them, and a burst whose shorts never decoded together counts as no measurement, not 0."""
    from cluster.config import config_from_dict
    from cluster.planner.calibration import ServingSample, calibrate, predicted_prefill

    cfg = config_from_dict({"decode": {"num_threads": 1}})
    scale = 1.3
    per_token = STEPS.decode(1, 64 + 20) * scale
    chunk = cfg.for_pool("decode").scheduler.chunk_size
    prefill = predicted_prefill(STEPS, 64, chunk)
    unloaded = [
        ServingSample(64, 40, [0.1 + per_token * i for i in range(40)], prefill) for _ in range(3)
    ]
    engine = STEPS.decode(K, 64 + 20) * scale
    long = BurstSample(900, 8, [100.0, 100.1], [1, 1], prefill_s=0.5)  # after the shorts
    bursts = [[*_burst(engine + extra * (K - 1)), long] for extra in (0.010, 0.001, 0.004)]
    bursts.append([*_burst(0.05, k=1), long])  # nothing to fit
    cost, raw = calibrate("local", unloaded, {"1": STEPS}, cfg, None, 4096, bursts)
    assert cost.decode_scale == pytest.approx(scale, rel=1e-6)
    assert cost.prefill_scale == pytest.approx(1.0, rel=1e-6)
    assert cost.stream_s == pytest.approx(0.004, rel=1e-6)
    assert [b["streams"] for b in raw["bursts"]] == [K, K, K, 1]
    assert cost.decode_contention == 0.0  # local: no other pool
