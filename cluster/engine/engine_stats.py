"""The engine's counters and its ``stats()`` snapshot (what metrics and the planner read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.engine.block_manager import BlockManager
from cluster.engine.handoff import Handoff
from cluster.engine.parallel import SampleGroups
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec import Speculator
from cluster.engine.structured import StructuredOutput


@dataclass(slots=True)
class EngineCounters:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_migrated_out: int = 0  # live migration: handed over to another decode replica
    num_migrated_in: int = 0  # taken over from another one
    num_migrations_resumed: int = 0  # paused for one that did not take it: decoded on here
    step_times: list[float] = field(default_factory=list)


def engine_stats(
    c: EngineCounters,
    sched: Scheduler,
    handoff: Handoff,
    samples: SampleGroups,
    block_manager: BlockManager,
    speculator: Speculator,
    structured: StructuredOutput,
) -> dict[str, Any]:
    return {
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        **handoff.stats(),
        **samples.stats(),
        "num_queued_prefill_tokens": sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.requests()
        ),
        "num_preemptions": sched.num_preemptions,
        "num_steps": c.num_steps,
        "num_prompt_tokens": c.num_prompt_tokens,
        "num_cached_prompt_tokens": c.num_cached_prompt_tokens,
        "num_generated_tokens": c.num_generated_tokens,
        "num_finished": c.num_finished,
        "num_aborted": c.num_aborted,
        "num_migrated_out": c.num_migrated_out,
        "num_migrated_in": c.num_migrated_in,
        "num_migrations_resumed": c.num_migrations_resumed,
        "prefix_cache_hit_rate": (
            c.num_cached_prompt_tokens / c.num_prompt_tokens if c.num_prompt_tokens else 0.0
        ),
        "kv": block_manager.stats(),
        "spec": speculator.stats(),
        "structured": structured.stats(),
    }
