"""P6 ``decode-scaling``: decode step tok/s at batch 1/4/16/32, context 128 and 1024.

How (docs/benchmarks/index.md, P6):
  1. One engine. For each (context, batch) the batch's prompt KV is filled synthetically through
     the decode-role API: ``add(prefill="remote")`` reserves the blocks, the bench writes
     random values into them (as a KV transfer would: untouched zero pages would make the
     attention gather unrealistically cheap), hands in a first token and calls ``kv_arrived``.
  2. Then the real ``engine.step()`` decodes the whole batch: a few warm-up steps, then timed
     steps. tok/s = batch / median step time. Phases are timed by ``StepTimer``.
  3. HF ``generate`` bs1 at context 128 runs right after our bs1 at 128 in every repetition;
     its decode tok/s = 1 / median gap between streamed tokens (the prefill left out).
  4. Repetitions alternate the order of the (context, batch) cells (ascending, descending) so a
     drift in machine load does not favour one batch size; ratios are taken per repetition and
     the median reported.

Keys: ``scaling_b32`` (b32 / b1 tok/s at ctx 128), ``scaling_b32_ctx1024``, ``b1_vs_hf`` (ours
bs1 / HF bs1 at ctx 128), ``overhead_share`` (share of the B=32 ctx-128 step outside
``runner.forward``, i.e. the model + lm_head), ``kv_waste`` (blocks in use x block_size / tokens
with KV, pooled over every timed decode step).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from benchmarks.harness import BenchContext, BenchReport
from benchmarks.hf_reference import decode_step_times, load_hf_model
from benchmarks.step_timer import PHASES, StepTimer
from benchmarks.workloads import bench_model_dir, make_engine, pin_threads, random_prompt, warm_up
from cluster.engine.engine import LLMEngine
from cluster.planner.measure.engine import start_batch

CONTEXTS = (128, 1024)
BATCHES = (1, 4, 16, 32)


@dataclass
class Cell:
    """Every timed step of one (context, batch) cell across repetitions."""

    step_s: list[list[float]] = field(default_factory=list)  # per repetition
    forward_s: list[list[float]] = field(default_factory=list)
    phases_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})


@dataclass
class KVUsage:
    reserved_slots: int = 0  # blocks in use x block_size, summed over snapshots
    tokens_with_kv: int = 0

    @property
    def waste(self) -> float:
        return self.reserved_slots / self.tokens_with_kv if self.tokens_with_kv else float("nan")


def _measure(
    engine: LLMEngine,
    timer: StepTimer,
    rng: random.Random,
    batch: int,
    context: int,
    num_warm: int,
    num_steps: int,
    cell: Cell,
    kv: KVUsage,
) -> float:
    """Decode ``num_steps`` timed steps of a fresh batch; returns tok/s (batch / median step)."""
    tag = f"c{context}-b{batch}-{len(cell.step_s)}"
    rids = start_batch(engine, rng, tag, batch, context, num_warm + num_steps + 2)
    for _ in range(num_warm):  # the first one admits the batch
        engine.step()
    steps: list[float] = []
    forwards: list[float] = []
    block_size = engine.config.cache.block_size
    for _ in range(num_steps):
        outputs, times = timer.step()
        assert len(outputs) == batch, f"expected a {batch}-wide decode step, got {len(outputs)}"
        steps.append(times.step)
        forwards.append(times.phases["forward"])
        for p in PHASES:
            cell.phases_s[p].append(times.phases[p])
        kv.reserved_slots += engine.stats()["kv"]["num_used_blocks"] * block_size
        kv.tokens_with_kv += sum(engine.requests[r].num_computed_tokens for r in rids)
    for rid in rids:
        engine.abort_request(rid)
    engine.step()  # flush the abort outputs
    cell.step_s.append(steps)
    cell.forward_s.append(forwards)
    return batch / statistics.median(steps)


def run(ctx: BenchContext) -> BenchReport:
    num_reps = ctx.pick(5, 3, 1)
    num_steps = ctx.pick(24, 10, 3)
    num_warm = ctx.pick(3, 2, 1)
    rng = random.Random(0)
    max_ctx, max_batch = max(CONTEXTS), max(BATCHES)
    per_req_blocks = -(-(max_ctx + num_warm + num_steps + 4) // ctx.config.cache.block_size)
    num_blocks = max_batch * per_req_blocks + 16
    ctx.progress(f"loading engine ({num_blocks} KV blocks) and HF reference")
    threads = pin_threads(ctx)
    engine = make_engine(ctx, {"cache.num_blocks": num_blocks}, role="decode")
    hf = load_hf_model(bench_model_dir(ctx), device=engine.runner.kv_cache.device)
    pin_threads(ctx)
    warm_up(engine, rng, 64, 4)
    decode_step_times(hf, random_prompt(rng, 64, engine.vocab_size), 4)
    timer = StepTimer(engine)

    cells = {(c, b): Cell() for c in CONTEXTS for b in BATCHES}
    tps: dict[tuple[int, int], list[float]] = {k: [] for k in cells}
    hf_tps: list[float] = []
    kv = KVUsage()
    order = [(c, b) for c in CONTEXTS for b in BATCHES]
    for rep in range(num_reps):
        for c, b in order if rep % 2 == 0 else order[::-1]:
            tps[(c, b)].append(
                _measure(engine, timer, rng, b, c, num_warm, num_steps, cells[(c, b)], kv)
            )
            ctx.progress(f"rep {rep + 1}/{num_reps} ctx {c} b{b}: {tps[(c, b)][-1]:.1f} tok/s")
            if (c, b) == (128, 1):
                prompt = random_prompt(rng, 128, engine.vocab_size)
                gaps = decode_step_times(hf, prompt, num_warm + num_steps + 1)[num_warm:]
                hf_tps.append(1.0 / statistics.median(gaps))
                ctx.progress(
                    f"rep {rep + 1}/{num_reps} HF generate bs1 ctx 128: {hf_tps[-1]:.1f} tok/s"
                )
    timer.remove()
    engine.check_integrity()

    def ratio(num: list[float], den: list[float]) -> float:
        return statistics.median(a / b for a, b in zip(num, den))

    b32 = cells[(128, 32)]
    shares = [1.0 - sum(f) / sum(s) for s, f in zip(b32.step_s, b32.forward_s)]
    keys = {
        "scaling_b32": ratio(tps[(128, 32)], tps[(128, 1)]),
        "scaling_b32_ctx1024": ratio(tps[(1024, 32)], tps[(1024, 1)]),
        "b1_vs_hf": ratio(tps[(128, 1)], hf_tps),
        "overhead_share": statistics.median(shares),
        "kv_waste": kv.waste,
    }
    table = []
    for (c, b), cell in cells.items():
        steps = [s for rep in cell.step_s for s in rep]
        row: dict[str, object] = {
            "arm": "ours",
            "ctx": c,
            "batch": b,
            "tok_s": statistics.median(tps[(c, b)]),
            "step_ms": 1e3 * statistics.median(steps),
        }
        total = sum(steps)
        for p in PHASES:
            row[f"{p}_%"] = 100.0 * sum(cell.phases_s[p]) / total
        table.append(row)
    table.append(
        {
            "arm": "hf_generate",
            "ctx": 128,
            "batch": 1,
            "tok_s": statistics.median(hf_tps),
            "step_ms": 1e3 / statistics.median(hf_tps),
        }
    )
    return BenchReport(
        keys=keys,
        table=table,
        targets={
            "scaling_b32": ">= 9",
            "scaling_b32_ctx1024": ">= 5",
            "b1_vs_hf": ">= 0.9",
            "overhead_share": "<= 0.10",
            "kv_waste": "<= 1.04",
        },
        details={
            "threads": threads,
            "num_reps": num_reps,
            "num_steps": num_steps,
            "num_warm_steps": num_warm,
            "tok_s_per_rep": {f"ctx{c}_b{b}": v for (c, b), v in tps.items()},
            "hf_tok_s_per_rep": hf_tps,
            "overhead_share_per_rep": shares,
            "overhead_share_ctx1024_b32": 1.0
            - sum(map(sum, cells[(1024, 32)].forward_s)) / sum(map(sum, cells[(1024, 32)].step_s)),
            "kv_reserved_slots": kv.reserved_slots,
            "kv_tokens_with_kv": kv.tokens_with_kv,
            "step_ms_per_rep": {
                f"ctx{c}_b{b}": [1e3 * statistics.median(r) for r in cell.step_s]
                for (c, b), cell in cells.items()
            },
        },
    )
