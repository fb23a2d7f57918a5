"""``pdserve bench`` loads the benchmarks, a distribution of their own, when it runs: where they
are not installed it says so and names the command that installs them (exit code 2)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from cluster import cli


def test_absent_benchmarks_name_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # import benchmarks: ModuleNotFoundError

    assert cli.main(["bench", "engine", "--smoke"]) == 2

    err = capsys.readouterr().err
    assert "benchmarks are not installed" in err
    assert "pip install -e ./benchmarks" in err and "make setup" in err
    assert "Traceback" not in err


def test_an_unrelated_benchmarks_package_is_not_taken_for_ours(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "benchmarks", types.ModuleType("benchmarks"))

    assert cli.main(["bench", "all", "--quick"]) == 2
    assert "pip install -e ./benchmarks" in capsys.readouterr().err


def test_a_dependency_missing_inside_the_benchmarks_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def import_module(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        cli.load_benchmarks()


def test_installed_benchmarks_run_through_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str | None]] = []

    def run_benchmark(name: str, mode: str, config: Any) -> int:
        calls.append((name, mode, config.model.path))
        return 0

    fake = types.ModuleType("benchmarks")
    fake.run_benchmark = run_benchmark  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks", fake)

    assert cli.main(["bench", "prefix", "--quick", "--model", "/nowhere"]) == 0
    assert calls == [("prefix", "quick", "/nowhere")]
