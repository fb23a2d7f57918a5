"""``serving.heap``: start-up objects frozen out of the collector, later garbage still collected."""

from __future__ import annotations

import gc
from typing import Any

from cluster.serving.heap import freeze_startup_heap, heap_stats


def test_startup_objects_are_frozen_and_later_cycles_still_collected() -> None:
    startup = [{"i": i} for i in range(50_000)]  # what a replica holds for its whole life
    try:
        frozen = freeze_startup_heap("test")
        assert frozen >= len(startup)
        assert heap_stats()["frozen"] >= len(startup)  # (pytest's other threads allocate too)
        assert len(heap_stats()["collections"]) == 3  # one count per generation

        cycle: dict[str, Any] = {}
        cycle["self"] = cycle  # garbage made after the freeze, reachable only from itself
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()  # this process is pytest's: give its objects back to the collector
    assert gc.get_freeze_count() < len(startup)  # given back (other threads may freeze too)
