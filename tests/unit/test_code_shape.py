"""The shape the codebase keeps: the engine's step reads schedule -> execute -> update, and the
block manager is the engine's alone. Function size and complexity are ruff's (C901, PLR0912,
PLR0915 in pyproject.toml) and the layering is import-linter's; no file has a line cap."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from cluster.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2] / "cluster"


def _called_names(node: ast.AST) -> list[str]:
    """The names of the functions and methods ``node`` calls, in source order."""
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    calls.sort(key=lambda c: (c.lineno, c.col_offset))
    return [
        c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
        for c in calls
    ]


def test_step_reads_schedule_execute_update_and_delegates_the_work() -> None:
    (fn,) = ast.parse(textwrap.dedent(inspect.getsource(LLMEngine.step))).body
    assert isinstance(fn, ast.FunctionDef)
    names = _called_names(fn)
    phases = [n for n in names if n.lstrip("_") in ("schedule", "execute", "update")]
    assert [p.lstrip("_") for p in phases] == ["schedule", "execute", "update"], names
    # The step is the three phases in order: the work lives in them, not in a loop here.
    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For | ast.While | ast.comprehension)]
    assert not loops, ast.unparse(fn)


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


def test_no_two_classes_share_a_name() -> None:
    """One name per concept (STYLE.md): two classes of one name in the package, private ones
    too, read as one thing in a traceback, a grep or a review."""
    where: dict[str, list[str]] = {}
    for p in sorted(ROOT.rglob("*.py")):
        if "pb" in p.relative_to(ROOT).parts:  # generated code
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{p.relative_to(ROOT)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, shared
