"""Where one ``engine.step()`` spends its wall time, without touching the engine's code.

Times the phases by wrapping the bound methods of one engine instance (the wrappers cost about
a microsecond per call):

    step = schedule + execute + update (token append, stop checks, detokenizer, outputs)
    execute = prepare (tensors, block tables, masks) + forward (the model + lm_head) + sample
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.engine import LLMEngine, RequestOutput

PHASES = ("schedule", "prepare", "forward", "sample", "update")


@dataclass(slots=True)
class StepTimes:
    step: float
    phases: dict[str, float]  # PHASES -> seconds


@dataclass
class StepTimer:
    engine: LLMEngine
    _acc: dict[str, float] = field(default_factory=dict)
    _originals: dict[tuple[Any, str], Callable[..., Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._wrap(self.engine, "schedule")
        runner = self.engine.runner
        self._wrap(runner, "execute")
        for name in ("prepare", "forward"):
            if hasattr(runner, name):
                self._wrap(runner, name)

    def _wrap(self, obj: Any, name: str) -> None:
        original = getattr(obj, name)
        acc = self._acc

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

        self._originals[(obj, name)] = original
        setattr(obj, name, timed)

    def step(self) -> tuple[list[RequestOutput], StepTimes]:
        """One real ``engine.step()``, timed by phase."""
        self._acc.clear()
        t0 = time.perf_counter()
        outputs = self.engine.step()
        total = time.perf_counter() - t0
        a = self._acc
        execute = a.get("execute", 0.0)
        prepare, forward = a.get("prepare", 0.0), a.get("forward", 0.0)
        phases = {
            "schedule": a.get("schedule", 0.0),
            "prepare": prepare,
            "forward": forward,
            "sample": max(execute - prepare - forward, 0.0),
            "update": max(total - a.get("schedule", 0.0) - execute, 0.0),
        }
        return outputs, StepTimes(total, phases)

    def remove(self) -> None:
        """Restore the engine's own methods."""
        for (obj, name), _original in self._originals.items():
            delattr(obj, name)  # the class attribute shows through again
        self._originals.clear()
