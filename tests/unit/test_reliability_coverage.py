"""docs/reliability/coverage.md names, for every row of the reliability matrix
(docs/reliability/matrix.md), the tests that cover it or the reason it has none; every test it
names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COVERAGE = ROOT / "docs" / "reliability" / "coverage.md"
MATRIX = ROOT / "docs" / "reliability" / "matrix.md"
ROW = re.compile(r"^\|\s*([A-Z][0-9]+)\s*\|(.*)\|(.*)\|\s*$", re.M)
TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def matrix_ids(doc: Path = MATRIX) -> list[str]:
    return re.findall(r"^\|\s*([A-Z][0-9]+)\s*\|", doc.read_text(), re.M)


def coverage_rows() -> dict[str, tuple[str, str]]:
    rows: dict[str, tuple[str, str]] = {}
    for rid, tests, notes in ROW.findall(COVERAGE.read_text()):
        assert rid not in rows, f"{rid} has two rows in {COVERAGE.name}"
        rows[rid] = (tests, notes)
    return rows


def test_every_matrix_row_has_a_test_or_a_reason() -> None:
    ids = matrix_ids()
    assert len(ids) >= 50  # the matrix was found and parsed
    rows = coverage_rows()
    missing = [rid for rid in ids if rid not in rows]
    assert not missing, f"rows of {MATRIX.name} missing from {COVERAGE.name}: {missing}"
    unknown = sorted(set(rows) - set(ids))
    assert not unknown, f"{COVERAGE.name} names rows {MATRIX.name} does not have: {unknown}"
    for rid, (tests, notes) in rows.items():
        if not TEST.search(tests):
            assert notes.strip().startswith("Not covered:") and len(notes.strip()) > 40, (
                f"{rid}: neither a test nor a written reason"
            )


def test_every_named_test_exists() -> None:
    named = {(f, t) for tests, _ in coverage_rows().values() for f, t in TEST.findall(tests)}
    assert named
    defined: dict[str, set[str]] = {}
    for f, t in sorted(named):
        path = ROOT / f
        assert path.is_file(), f"{f} does not exist"
        if f not in defined:
            tree = ast.parse(path.read_text())
            defined[f] = {
                n.name
                for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
        assert t.startswith("test") and t in defined[f], f"{f}::{t} does not exist"
