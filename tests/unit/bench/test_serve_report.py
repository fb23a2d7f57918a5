"""P1's report from recorded runs: per-class SLOs from the unloaded runs (the slowest arm's p50
per class), each arm's own knee, ``knee_found`` and the arm named when it has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import BenchContext
from benchmarks.serve import _report
from cluster.planner.measure.arms import ArmRecords, class_slos
from cluster.planner.measure.load import RequestRecord
from tests.helpers import make_config


def _rec(cls: str, ttft: float, tpot: float, n: int = 5) -> RequestRecord:
    r = RequestRecord(prompt_len=100 if cls == "chat" else 900, max_tokens=n, cls=cls)
    r.send = 0.0
    r.chunk_times = [ttft + i * tpot for i in range(n)]
    r.output_tokens = n
    return r


def _runs(knees: dict[str, float | None], rates: list[float]) -> ArmRecords:
    runs = ArmRecords(rates)
    for arm, k in knees.items():
        # Unloaded: chat 0.1 s TTFT / 10 ms TPOT, long 1 s / 20 ms (disagg slower: 0.2 / 2 s).
        slow = 2.0 if arm == "disagg" else 1.0
        runs.unloaded[arm] = [_rec("chat", 0.1 * slow, 0.01), _rec("long", 1.0 * slow, 0.02)]
        for rate in rates:
            good = k is not None and rate <= k
            ttft = 0.1 if good else 5.0  # over 3 x 0.2 s when the arm is past its knee
            recs = [_rec("chat", ttft, 0.01) for _ in range(9)] + [_rec("long", 1.5, 0.02)]
            runs.loaded.setdefault(arm, {})[rate] = (recs, 10.0)
    return runs


def test_slos_are_per_class_from_the_slowest_arm() -> None:
    slos = class_slos(
        _runs({"disagg": 1.0, "colocated": 1.0, "colocated_chunked": 1.0}, [1.0]).unloaded
    )
    assert slos.bounds["chat"] == pytest.approx((0.6, 0.02))  # 3 x 0.2 s, 2 x 10 ms
    assert slos.bounds["long"] == pytest.approx((6.0, 0.04))


def test_each_arm_has_its_own_knee_and_knee_found(tmp_path: Path) -> None:
    ctx = BenchContext("serve", "quick", make_config(), results_dir=tmp_path)
    rates = [0.25, 0.5, 1.0]
    report = _report(
        ctx, _runs({"disagg": 1.0, "colocated": 0.25, "colocated_chunked": 0.5}, rates)
    )
    assert report.details["knee_rate"] == {
        "disagg": 1.0,
        "colocated": 0.25,
        "colocated_chunked": 0.5,
    }
    assert report.keys["knee_found"] == 1.0
    assert report.details["p99_tpot_rate"] == 0.25  # the lower of disagg's and colocated's
    # Goodput at each arm's own knee: 10 good requests in 10 s for every arm here.
    assert report.keys["goodput_ratio_vs_colocated"] == pytest.approx(1.0)


def test_an_arm_without_a_knee_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ctx = BenchContext("serve", "quick", make_config(), results_dir=tmp_path)
    report = _report(
        ctx, _runs({"disagg": 1.0, "colocated": None, "colocated_chunked": 1.0}, [0.25, 1.0])
    )
    assert report.keys["knee_found"] == 0.0
    assert report.details["no_knee"] == ["colocated"]
    assert "no knee for colocated" in capsys.readouterr().err


def test_a_burst_is_short_prompts_at_once_then_one_long_one_while_they_decode() -> None:
    from cluster.planner.measure.arms import burst_items, unloaded_items
    from cluster.planner.workload import MIXED_LONG

    items, offsets = burst_items(MIXED_LONG, 8, 49152, 1.0)
    short = min(MIXED_LONG.classes, key=lambda c: c.prompt[1])
    long = max(MIXED_LONG.classes, key=lambda c: c.prompt[1])
    assert [i.cls for i in items] == [short.name] * 8 + [long.name]
    # All at once; the long one is held by run_load until the shorts decode (its gate).
    assert offsets == [0.0] * 9
    assert len({tuple(i.token_ids) for i in items}) == 9
    # Prompts no other run sends: not the unloaded baseline's, nor its warm-up's.
    others = unloaded_items(MIXED_LONG, 8, 49152, 1.0) + unloaded_items(
        MIXED_LONG, 1, 49152, 1.0, seed=7
    )
    assert not {tuple(i.token_ids) for i in items} & {tuple(i.token_ids) for i in others}
    smoke, _ = burst_items(MIXED_LONG, 2, 49152, 0.05)  # the lengths scale
    assert [
        len(i.token_ids) <= 0.05 * c.prompt[1] + 1
        for i, c in zip(smoke, (short, short, long), strict=True)
    ] == [True] * 3
