"""Interleaved arms run in an order shuffled each repetition (``harness.interleaved_order``; P4
and P5): with the order rotated, every arm always followed the same arm, and P4's int8 pull,
always right after ``int8_shm`` had written the same destination blocks, read 11% faster than
over all predecessors (``bench/kv_transfer.py``)."""

from __future__ import annotations

import itertools
from collections import Counter

from benchmarks import kv_stream
from benchmarks.harness import interleaved_order
from benchmarks.kv_transfer import ARMS, arm_order


def test_every_repetition_runs_every_arm_once() -> None:
    for rep in range(100):
        order = arm_order(rep)
        assert sorted(order) == sorted(ARMS)


def test_the_order_repeats_run_to_run() -> None:
    assert [arm_order(rep) for rep in range(10)] == [arm_order(rep) for rep in range(10)]


def test_each_arm_follows_many_others_about_evenly() -> None:
    reps = 65  # a full run's warm-up and repetitions
    follows: dict[str, Counter[str]] = {arm: Counter() for arm in ARMS}
    for rep in range(reps):
        order = arm_order(rep)
        for before, arm in itertools.pairwise(order):
            follows[arm][before] += 1
    for arm, preceding in follows.items():
        # Rotated, an arm followed one arm in all but one repetition of each cycle.
        assert len(preceding) >= len(ARMS) - 3, (arm, preceding)
        assert max(preceding.values()) <= reps // 3, (arm, preceding)
    assert follows["int8_zmq_ipc"]["int8_shm"] <= reps // 4


def test_p5_shuffles_its_three_arms_too() -> None:
    orders = {interleaved_order(kv_stream.ARMS, rep) for rep in range(8)}
    assert all(sorted(o) == sorted(kv_stream.ARMS) for o in orders)
    arms = kv_stream.ARMS
    rotations = {arms[i:] + arms[:i] for i in range(len(arms))}
    assert orders - rotations  # an arm also follows another than the rotation's one
    assert {o[0] for o in orders} == set(arms)
