"""The shape the codebase keeps (issue 8): small engine files, a plain scheduler, a short step,
a small torch-free common layer. A change that grows past these should split the file instead."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from cluster.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2] / "cluster"


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_engine_file_over_300_lines() -> None:
    big = {
        str(p.relative_to(ROOT)): _lines(p)
        for p in (ROOT / "engine").rglob("*.py")
        if _lines(p) > 300
    }
    assert not big, big


def test_the_scheduler_stays_under_250_lines() -> None:
    assert _lines(ROOT / "engine" / "scheduler.py") < 250


def test_step_reads_schedule_execute_update_in_under_10_lines() -> None:
    (fn,) = ast.parse(inspect.getsource(LLMEngine.step).strip()).body
    assert isinstance(fn, ast.FunctionDef)
    body_lines = fn.end_lineno - fn.body[0].lineno + 1  # type: ignore[operator]
    assert body_lines < 10, body_lines
    source = inspect.getsource(LLMEngine.step)
    assert source.index("schedule(") < source.index("execute(") < source.index("update(")


def test_common_holds_only_a_small_shared_core() -> None:
    total = sum(_lines(p) for p in (ROOT / "common").glob("*.py"))
    assert total < 900, total


# The planner's simulator assembles replicas of its own from the engine's Scheduler and
# BlockManager (the engine's policy in simulated time): it owns those, it reads no engine's.
OWN_BLOCK_MANAGER = {"planner/simulator.py"}


def test_nothing_outside_the_engine_reads_the_block_manager() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] != "engine"
        and str(p.relative_to(ROOT)) not in OWN_BLOCK_MANAGER
        and "block_manager" in p.read_text()
    ]
    assert not offenders, offenders
