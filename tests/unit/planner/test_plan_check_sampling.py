"""`plan --validate`'s reading of its own runs: how far a run's requests let each measured figure
stray (``sampling_%``) and the chance an exact model would still pass every figure
(``exact_model_pass_p``): near 1 when the requests pin the figures down, far below 1 when a
figure sits on its SLO bound and a few requests move it across."""

from __future__ import annotations

import math
import random

import pytest

from cluster.planner.measure.load import RequestRecord, compute_metrics
from cluster.planner.measure.validate import (
    BOOTSTRAP,
    FIGURES,
    TOLERANCE,
    _sampling,
    relative_error,
)
from cluster.planner.workload import SLOs

DURATION_S = 20.0


def record(send: float, ttft: float, tpot: float, tokens: int = 17) -> RequestRecord:
    times = [send + ttft + i * tpot for i in range(tokens)]
    return RequestRecord(
        prompt_len=64,
        max_tokens=tokens,
        cls="chat",
        send=send,
        chunk_times=times,
        chunk_tokens=[1] * tokens,
        output_tokens=tokens,
    )


def test_relative_error() -> None:
    assert relative_error(1.5, 1.0) == pytest.approx(0.5)
    assert relative_error(0.75, 1.0) == pytest.approx(-0.25)
    assert relative_error(0.0, 0.0) == 0.0  # no goodput predicted, none measured
    assert relative_error(0.1, 0.0) == math.inf
    assert math.isnan(relative_error(1.0, math.nan))


def test_identical_requests_pin_every_figure_down() -> None:
    records = [record(0.5 * i, 0.2, 0.05) for i in range(24)]
    slos = SLOs({"chat": (1.0, 0.1)})  # every request well within
    measured = compute_metrics(records, DURATION_S, slos=slos)
    s = _sampling(records, DURATION_S, slos, measured, random.Random(1))
    assert set(s.spread_pct) == {label for label, _, _ in FIGURES}
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in s.spread_pct.values())
    assert s.exact_pass == 1.0


def test_a_figure_on_its_slo_bound_leaves_the_check_a_coin_toss() -> None:
    rng = random.Random(3)
    # Latencies with a modest spread, but the TPOT bound sits inside it: a quarter of the
    # requests meet it, so a resample's goodput moves by a request or two in four.
    records = [record(0.5 * i, 0.2 + 0.02 * rng.random(), 0.04 + 0.02 * (i % 4)) for i in range(24)]
    slos = SLOs({"chat": (1.0, 0.045)})
    measured = compute_metrics(records, DURATION_S, slos=slos)
    assert measured["goodput"] == pytest.approx(6 / DURATION_S)
    s = _sampling(records, DURATION_S, slos, measured, random.Random(1))
    assert s.spread_pct["ttft_p50"] < 100 * TOLERANCE  # the latencies are pinned down
    assert s.spread_pct["goodput"] > 100 * TOLERANCE  # goodput is not
    # An exact model passes only the resamples whose goodput stayed within 25%.
    assert 0.0 < s.exact_pass < 0.6
    # ... and the share is the bootstrap's, a multiple of 1 / BOOTSTRAP.
    assert (s.exact_pass * BOOTSTRAP) == pytest.approx(round(s.exact_pass * BOOTSTRAP))


def test_nothing_measured_is_no_pass() -> None:
    # One output token each: no TPOT at all, so the check cannot pass on it.
    records = [record(0.5 * i, 0.2, 0.05, tokens=1) for i in range(8)]
    slos = SLOs({"chat": (1.0, 0.1)})
    measured = compute_metrics(records, DURATION_S, slos=slos)
    s = _sampling(records, DURATION_S, slos, measured, random.Random(1))
    assert s.spread_pct["tpot_p50"] == math.inf
    assert s.exact_pass == 0.0


def test_loaded_prefill_scale_reads_long_uncached_prompts_only() -> None:
    from cluster.planner.calibration import predicted_prefill
    from cluster.planner.measure.validate import LONG_PROMPT, loaded_prefill_scale
    from tests.unit.planner.synthetic import costs

    table, chunk = costs(1.0), 256

    def served(prompt_len: int, scale: float, cached: int = 0) -> RequestRecord:
        r = record(0.0, 0.5, 0.05)
        r.prompt_len, r.cached_tokens = prompt_len, cached
        r.phases = {"prefill_ms": 1000 * scale * predicted_prefill(table, prompt_len, chunk)}
        return r

    records = [served(768, 1.1), served(1024, 1.2), served(900, 1.3)]
    records += [served(96, 3.0), served(1024, 3.0, cached=512)]  # short, or partly cached
    failed = served(1024, 3.0)
    failed.error = "UNAVAILABLE"
    assert loaded_prefill_scale([*records, failed], table, chunk) == pytest.approx(1.2)
    assert loaded_prefill_scale([served(LONG_PROMPT - 1, 1.0)], table, chunk) is None
