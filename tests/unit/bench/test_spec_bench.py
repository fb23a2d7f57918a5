"""P9's arms share one runner, so one KV pool, with an engine (a block manager) each.

An arm's prefix cache must not outlive the other arm's use of the pool: a block it names may
hold the other engine's KV by then, and a prefix hit on it emits other tokens. That is what
made an early ``pdserve bench spec --quick`` report ``greedy_identical=0`` (no-copy prompts,
speculation off vs on); ``run_arm`` empties the arm's prefix cache first.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import BenchContext
from benchmarks.spec import run_arm
from benchmarks.workloads import make_engine, make_runner
from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import make_config

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True)


def _context(model_dir: Path) -> BenchContext:
    config = make_config(**{"model.path": str(model_dir), "model.num_threads": 1})
    return BenchContext("spec", "smoke", config)


def _generate(engine: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    engine.add(EngineRequest(rid, prompt, PARAMS))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def test_an_arm_never_reads_kv_the_other_arm_overwrote(tiny_model_dir: Path) -> None:
    ctx = _context(tiny_model_dir)
    runner = make_runner(ctx)
    off = make_engine(ctx, {"decode.speculative.method": "none"}, runner=runner)
    on = make_engine(ctx, {"decode.speculative.method": "ngram"}, runner=runner)
    block = off.block_manager.block_size
    shared = [20 + i % 50 for i in range(3 * block)]  # three full blocks both prompts start with
    mine, other = [*shared, 101, 102, 103], [7 + i % 40 for i in range(4 * block)]
    ref = run_arm(ctx, off, {"a": mine}, 1, PARAMS).tokens["a"]
    # The other engine writes its KV into the same physical blocks (its allocator is its own).
    run_arm(ctx, on, {"b": other}, 1, PARAMS)
    again = run_arm(ctx, off, {"a2": mine}, 1, PARAMS).tokens["a2"]
    assert again == ref
    # Without the reset, the same sequence hits the stale prefix: the test can tell.
    assert _generate(off, "warm", mine) == ref  # off caches its prefix blocks again
    run_arm(ctx, on, {"b2": other}, 1, PARAMS)
    assert _generate(off, "stale", mine) != ref
    assert off.stats()["num_cached_prompt_tokens"] > 0


def test_a_mismatch_names_where_the_arms_part_and_which_arm_left_the_other_pairs() -> None:
    from benchmarks.harness import ArmRun
    from benchmarks.spec import _mismatches

    def pair(q: int, off: list[int], on: list[int]) -> dict[str, ArmRun]:
        return {
            "off": ArmRun("off", tokens={f"copy2-off-{q}": off, f"copy3-off-{q}": [1, 2]}),
            "on": ArmRun("on", tokens={f"copy2-on-{q}": on, f"copy3-on-{q}": [1, 2]}),
        }

    good = [5, 6, 7, 8]
    cells = {("copy", 1): [pair(0, good, good), pair(1, [5, 6, 9, 9], good), pair(2, good, good)]}
    assert _mismatches(cells) == ["copy b1 copy2-off-1 from token 2; off left the other pairs"]
    # the other pairs disagree among themselves: no arm is named
    cells = {("copy", 1): [pair(0, good, [5, 1]), pair(1, good, [5, 6, 7, 0])]}
    assert _mismatches(cells) == [
        "copy b1 copy2-off-0 from token 1",
        "copy b1 copy2-off-1 from token 3",
    ]
