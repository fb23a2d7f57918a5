"""pdserve: a disaggregated prefill/decode LLM serving cluster on Ray Serve.

``from cluster import LLM, SamplingParams`` is the offline API. Importing the package stays
torch-free: ``LLM`` loads the engine (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from cluster.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
