"""`import cluster` and the torch-free layers must not pull torch (the router relies on it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    [
        "cluster",
        "cluster.common",
        "cluster.common.tokenizer",
        "cluster.common.sampling_params",
        "cluster.common.hashing",
        "cluster.common.json_schema",
        "cluster.config",
        "cluster.common.kv_layout",
        # The router is torch-free: its replicas never load torch or transformers.
        "cluster.router.ingress",
        "cluster.router.requests",
        "cluster.router.responses",
        "cluster.router.auth",
        "cluster.router.relay",
        # The Serve layer is torch-free too: the router and the Serve controller (autoscaling
        # policies, request routers) import it.
        "cluster.serving.calls",
        "cluster.serving.options",
        "cluster.serving.routers",
        "cluster.serving.routing_policy",
        "cluster.serving.metrics",
        "cluster.serving.signals",
        "cluster.serving.autoscaling",
        "cluster.serving.replica",
        # The planner simulates the engine's scheduler without its runner: torch-free too.
        "cluster.planner.plan",
        "cluster.planner.simulator",
        "cluster.planner.cli",
    ],
)
def test_module_does_not_import_torch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "from cluster import SamplingParams\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_engine_starts_without_importing_transformers(tiny_model_dir: Path) -> None:
    """A pool replica's engine reads config.json and the weights itself: importing
    transformers would cost every replica start ~4 s (loader.CheckpointConfig)."""
    code = (
        "import sys\n"
        "from tests.helpers import tiny_config\n"
        "from cluster.engine.engine import LLMEngine\n"
        f"LLMEngine(tiny_config({str(tiny_model_dir)!r}))\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
