"""Shared fixtures. Unit tests use a tiny random Llama or the fake runner; tests marked
``integration`` use the real default model (converted once by ``make model``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Tests run several engines side by side: keep torch to the cores we have, shared between the
# pytest-xdist workers (`make unit` runs one per core).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, (os.cpu_count() or 2) // _WORKERS))))

from tests.helpers import make_config  # noqa: E402 (after the thread count, before torch)

# Triton's interpreter where there is no CUDA device (the GPU path's kernels run on CPU in
# tests/unit/gpu_path). Its jit decorator reads the switch when a kernel module is imported, so
# it is set here, before any test module is collected: an xdist worker collects tests/gpu, whose
# modules import Triton, before tests/unit/gpu_path's own conftest (a fresh-clone run failed
# every interpreter test so). With CUDA, the device tests get the compiled kernels.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


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


# The modules whose tests run a Ray cluster: the session's (`serve_cluster`) or their own
# (`pdserve serve` as a process, `ray start` nodes). Under pytest-xdist (`make unit`) they run one
# after another on one worker: one Ray instance per session, and no two clusters' processes
# competing for the cores. Every other module goes to one worker whole (its module fixtures, such
# as a real-model deployment, are built once), spread over all workers.
RAY_MODULES = (
    "tests/serve/",
    "tests/integration/test_bench_cluster_smoke.py",
    "tests/integration/test_cluster_real.py",
    "tests/integration/test_launcher.py",
    "tests/integration/test_multinode.py",
    "tests/integration/test_plan_check_smoke.py",
    "tests/integration/test_readme_snippets.py",
    "tests/integration/test_spec_cluster_real.py",
)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def runs_ray(nodeid: str) -> bool:
    return module_of(nodeid).startswith(RAY_MODULES)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-by-scope, the scope being "ray" for the Ray modules and the module for the
    rest, in collection order (the Ray tests are collected first: the longest scope starts at
    once). Scoped by node id: xdist's own `xdist_group` marks do not reach the controller under
    pytest 9.2."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class RayOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if runs_ray(nodeid) else module_of(nodeid)

    return RayOnOneWorker(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    # Full counts and soaks run only when asked for: `-m nightly` (or any -m naming it).
    markexpr = config.getoption("markexpr", "") or ""
    nightly = "nightly" in markexpr and "not nightly" not in markexpr
    skip_nightly = pytest.mark.skip(reason="nightly: full counts, run with -m nightly")
    items.sort(key=lambda item: not runs_ray(item.nodeid))  # stable: the Ray modules first
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "nightly" in item.keywords and not nightly:
            item.add_marker(skip_nightly)
        if runs_ray(item.nodeid):
            item.add_marker(pytest.mark.ray)
        elif "serve_cluster" in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(
                f"{item.nodeid} uses serve_cluster: add its module to RAY_MODULES"
            )


from tests.serve_fixtures import serve_cluster  # noqa: E402, F401 (session-wide Ray + Serve)
