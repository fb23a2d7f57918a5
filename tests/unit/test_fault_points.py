"""Fault points armed at run time (the Ray fault tests drive one phase at a time with them)."""

from __future__ import annotations

import threading

import pytest

from cluster.common.faults import FaultInjected, FaultPoints


def test_arm_applies_to_the_next_hit_only() -> None:
    fp = FaultPoints()
    fp.hit("x")
    fp.hit("x")
    fp.arm("x=raise")
    with pytest.raises(FaultInjected):
        fp.hit("x")
    fp.hit("x")  # one-shot


def test_pause_is_visible_and_rearmable() -> None:
    fp = FaultPoints()
    for _ in range(2):
        fp.arm("p=pause")
        t = threading.Thread(target=fp.hit, args=("p",))
        t.start()
        assert fp.wait_paused("p", 5)
        assert fp.paused() == ["p"]
        fp.release("p")
        t.join(5)
        assert not t.is_alive() and fp.paused() == []
    fp.hit("p")  # released and not re-armed: passes


def test_arm_rejects_a_bad_spec() -> None:
    with pytest.raises(ValueError, match="unknown action"):
        FaultPoints().arm("p=explode")
