"""Shared fixtures. Unit tests use a tiny random Llama or the fake runner; tests marked
``integration`` use the real default model (converted once by ``make model``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Tests run several engines side by side on 2 cores: keep torch to the cores we have.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from tests.helpers import make_config


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.engine.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The converted default model; converting it here if `make model` has not."""
    from cluster.engine.models.default_model import ensure_default_model

    return ensure_default_model(make_config())


@pytest.fixture(scope="session")
def real_workload(real_model_dir: Path) -> Any:
    """The real model's prompts and transformers references (tests/real_workload.py), once."""
    from tests.real_workload import build_real_workload

    return build_real_workload(real_model_dir)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    # Full counts and soaks run only when asked for: `-m nightly` (or any -m naming it).
    markexpr = config.getoption("markexpr", "") or ""
    nightly = "nightly" in markexpr and "not nightly" not in markexpr
    skip_nightly = pytest.mark.skip(reason="nightly: full counts, run with -m nightly")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "nightly" in item.keywords and not nightly:
            item.add_marker(skip_nightly)


from tests.serve_fixtures import serve_cluster  # noqa: E402, F401 (session-wide Ray + Serve)
