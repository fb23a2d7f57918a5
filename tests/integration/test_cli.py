from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_generate_streams_paris(real_model_dir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert "Paris" in out.stdout, out.stdout + out.stderr


def test_bad_input_is_a_clear_error_not_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 2
    assert "temperature: must be in [0, 2]" in out.stderr and "Traceback" not in out.stderr
