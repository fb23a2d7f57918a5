"""pdserve: a disaggregated prefill/decode LLM serving cluster on Ray Serve.

``from cluster import LLM, SamplingParams`` is the offline API. Importing the package stays
torch-free: ``LLM`` loads the engine (and torch) on first use.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any


def _short_openmp_spin() -> None:
    """Idle OpenMP threads sleep after about a millisecond instead of spinning for ~20.

    torch's OpenMP (libgomp) threads spin after every parallel region (300,000 pauses by default)
    and so hold every core the runtime has between one small torch op and the next, while the
    native kernels' own threads wait for a core (the docs' design decisions have the cost). Set
    before torch loads (its OpenMP reads the environment once); a process that already imported
    torch, or set its own OpenMP wait policy, keeps what it has.
    """
    if "torch" in sys.modules:
        if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
            # say so: its spinning threads slow every decode step of this process
            import logging

            logging.getLogger(__name__).warning(
                "torch was imported before cluster: its OpenMP threads keep spinning after each "
                "op and slow the native kernels (batch-1 decode ~1.5x slower on 2 cores); "
                "import cluster first, or set GOMP_SPINCOUNT=10000 before torch loads"
            )
        return
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"
    os.environ.setdefault("KMP_BLOCKTIME", "1")  # Intel OpenMP builds (ms; default 200)


_short_openmp_spin()

from cluster.common.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from cluster.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from cluster.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
