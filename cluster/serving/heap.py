"""The Python heap of a long-lived server process: its start-up objects frozen, out of the GC.

A pool replica (or the router) holds a few hundred thousand objects from start-up (torch,
transformers, Ray, the model's modules) that live as long as the process. CPython's full
(generation 2) collection walks all of them, holding the GIL, and in a replica each such
pause stalls the engine thread and every stream at once (the docs' design decisions have the
figures). ``freeze_startup_heap`` collects once, then moves every object alive to the
permanent generation (``gc.freeze``): later full collections walk only what was made since.
Objects allocated afterwards are collected as before; a start-up object that later becomes
cyclic garbage stays (none is expected: the collection just before the freeze takes what
start-up left behind).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze every object alive now; returns how many are frozen in all."""
    t0 = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - t0) * 1000
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d start-up objects frozen out of the collector (a full collection took %.0f ms)",
        what,
        frozen,
        collect_ms,
    )
    return frozen


def heap_stats() -> dict[str, Any]:
    """For ``stats()``: objects frozen, and the collections per generation so far."""
    return {
        "frozen": gc.get_freeze_count(),
        "collections": [g["collections"] for g in gc.get_stats()],
    }
