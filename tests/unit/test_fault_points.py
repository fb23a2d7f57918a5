"""Fault points armed at run time (the Ray fault tests drive one phase at a time with them)."""

from __future__ import annotations

import asyncio
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


def test_fault_points_outside_test_mode_are_inert_and_refuse_arming() -> None:
    from cluster.config import TestingConfig

    fp = FaultPoints.from_config(TestingConfig())  # production: testing.enabled is false
    assert not fp.enabled
    fp.hit("p")
    asyncio.run(fp.hit_async("p"))
    assert not fp.armed("p")
    with pytest.raises(PermissionError, match=r"test-only.*testing\.enabled"):
        fp.arm("p=raise")
    fp.hit("p")  # still inert: nothing was armed
    with pytest.raises(PermissionError, match="test-only"):
        FaultPoints(["p=raise"], enabled=False)


def test_fault_points_in_test_mode_come_from_the_config() -> None:
    from cluster.config import TestingConfig

    fp = FaultPoints.from_config(TestingConfig(enabled=True, fault_points=("p:2=raise",)))
    assert fp.enabled and fp.armed("p")
    fp.hit("p")
    with pytest.raises(FaultInjected):
        fp.hit("p")
    fp.arm("q=raise")
    with pytest.raises(FaultInjected):
        asyncio.run(fp.hit_async("q"))
