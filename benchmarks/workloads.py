"""Shared pieces of the engine benchmarks: the model, engines, prompts and per-request clocks.

Every arm of a benchmark runs in this one process with the same torch thread count, so arms
measured side by side differ only in what they are meant to compare.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ArmRun, BenchContext
from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig, cpu_count
from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput
from cluster.engine.runner import ModelRunner
from cluster.engine.runner_registry import create_runner
from cluster.planner.measure.engine import exact_tokens, model_dir, random_prompt
from cluster.planner.measure.machine import machine_busy_s


def bench_threads(ctx: BenchContext) -> int:
    """Torch threads for every arm: the config's, else every core this process may use."""
    return ctx.config.model.num_threads or cpu_count()


def pin_threads(ctx: BenchContext) -> int:
    """Set (again) the one thread count all arms share; HF arms run in this process too."""
    n = bench_threads(ctx)
    torch.set_num_threads(n)
    return n


def bench_model_dir(ctx: BenchContext) -> Path:
    """The checkpoint every arm loads: the config's model; in smoke mode, unless the config
    names one, the tiny random model."""
    return model_dir(ctx.config, ctx.mode)


def engine_config(ctx: BenchContext, overrides: Mapping[str, Any] | None = None) -> ClusterConfig:
    """The run's config on the benchmark model and thread count, plus dotted overrides."""
    dotted: dict[str, Any] = {
        "model.path": str(bench_model_dir(ctx)),
        "model.num_threads": bench_threads(ctx),
    }
    dotted.update(overrides or {})
    return ctx.config.replace(dotted)


def make_runner(ctx: BenchContext, overrides: Mapping[str, Any] | None = None) -> ModelRunner:
    return create_runner(engine_config(ctx, overrides))


def make_engine(
    ctx: BenchContext,
    overrides: Mapping[str, Any] | None = None,
    runner: ModelRunner | None = None,
    role: str = "colocated",
) -> LLMEngine:
    """An engine; arms that differ only in scheduler or cache policy may share one runner
    (same weights in the same memory), provided they never hold requests at the same time."""
    return LLMEngine(engine_config(ctx, overrides), runner=runner, role=role)


def warm_up(engine: LLMEngine, rng: random.Random, prompt_len: int, num_tokens: int) -> None:
    """One request end to end: first-call allocations and lazy inits happen outside the clock."""
    engine.add(
        EngineRequest(
            "warm-up", random_prompt(rng, prompt_len, engine.vocab_size), exact_tokens(num_tokens)
        )
    )
    drain(engine, {})


# An arm that got less than this share of its cores shared the machine with other work. With
# torch's spinning OpenMP threads such an arm runs many times slower, not just somewhat slower.
MIN_CPU_UTIL = 0.93


def max_pair_retries(ctx: BenchContext) -> int:
    """How often a disturbed pair of long arms is run again (never in smoke: no real timing)."""
    return int(ctx.pick(2, 2, 0))


def run_pair(
    ctx: BenchContext,
    pair: int,
    num_pairs: int,
    names: Sequence[str],
    run: Callable[[str], ArmRun],
    describe: Callable[[ArmRun], str],
    disturbed: list[dict[str, float]],
) -> dict[str, ArmRun]:
    """One pair of interleaved arms (A B on even pairs, B A on odd ones), run again at most
    ``max_pair_retries`` times while another job took cores from either arm (``disturbed``
    collects the utilizations of the pairs thrown away)."""
    for attempt in range(max_pair_retries(ctx) + 1):
        done: dict[str, ArmRun] = {}
        for name in names if pair % 2 == 0 else names[::-1]:
            pin_threads(ctx)
            done[name] = run(name)
            ctx.progress(f"pair {pair + 1}/{num_pairs} {name}: {describe(done[name])}")
        utils = {name: r.cpu_util for name, r in done.items()}
        if min(utils.values()) >= MIN_CPU_UTIL or attempt == max_pair_retries(ctx):
            break
        disturbed.append(utils)
        ctx.progress(f"pair {pair + 1} disturbed by other work (cpu util {utils}): again")
    return done


class CpuMeter:
    """How much of this arm's cores other work left it, over a stretch of wall time: near 1
    when nothing else ran, well below when other processes took cores (read its figures with
    care). Other work is the machine's busy time less this process's own CPU time (every torch
    thread); only what exceeds the cores the arm does not use counts. The arm's own idle time
    (a batch-1 decode that cannot keep every thread busy) is not a disturbance. Without
    ``/proc/stat``: this process's CPU time over its threads' wall time, as before."""

    def __init__(
        self,
        threads: int,
        *,
        num_cores: int | None = None,
        busy: Callable[[], float | None] = machine_busy_s,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.threads = threads
        # every core /proc/stat counts (the machine's, not this process's affinity)
        self.num_cores = num_cores if num_cores is not None else (os.cpu_count() or 1)
        self._busy_fn, self._own_fn, self._clock = busy, own, clock
        self._wall = clock()
        self._cpu = own()
        self._busy = busy()

    def utilisation(self) -> float:
        wall = self._clock() - self._wall
        if wall <= 0:
            return 1.0
        own = self._own_fn() - self._cpu
        busy = self._busy_fn()
        if busy is None or self._busy is None:
            return own / (wall * self.threads)
        others = max(0.0, busy - self._busy - own)
        spare = max(0, self.num_cores - self.threads) * wall  # cores this arm leaves free
        taken = max(0.0, others - spare)
        return max(0.0, 1.0 - taken / (wall * self.threads))


@dataclass(slots=True)
class Timeline:
    """One request as the client sees it: send time and the time of every streamed token."""

    send: float
    token_times: list[float] = field(default_factory=list)
    finished: bool = False

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.send

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


def record(outputs: Iterable[RequestOutput], timelines: Mapping[str, Timeline], now: float) -> None:
    """Stamp each output's tokens with ``now`` (the step's return: when a client could see them)."""
    for out in outputs:
        tl = timelines.get(out.request_id)
        if tl is None:
            continue
        tl.token_times.extend([now] * len(out.new_token_ids))
        tl.finished = tl.finished or out.finished


def drain(engine: LLMEngine, timelines: Mapping[str, Timeline], max_steps: int = 1_000_000) -> int:
    """Step until the engine is idle, recording token times; returns the number of steps."""
    for n in range(max_steps):
        if not engine.has_unfinished_requests():
            return n
        outputs = engine.step()
        record(outputs, timelines, time.perf_counter())
    raise RuntimeError(f"engine not idle after {max_steps} steps")


def _run_group(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams, run: ArmRun
) -> None:
    """Send ``prompts`` together and step until they finish: every token as it comes, the
    steps in which the whole group decodes, and the time after the group's first token."""
    spec0 = engine.speculator.stats()
    t0 = time.perf_counter()
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, params))
    first: float | None = None  # the group's first token (batch 1: the request's)
    last = t0
    while engine.has_unfinished_requests():
        decoding = sum(1 for r in engine.scheduler.running if r.output_token_ids)
        start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if decoding == len(prompts) and engine.last_num_scheduled == len(prompts):
            run.step_s.append(now - start)
        for out in outputs:
            if out.new_token_ids:
                run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                last = now
        if first is None and all(rid in run.tokens for rid in prompts):
            first = now  # every request of the group decodes from here on
    assert first is not None
    n = sum(len(run.tokens[rid]) for rid in prompts)
    run.total_tokens += n
    run.total_s += last - t0
    run.decode_tokens += n - len(prompts)
    run.decode_s += last - first
    spec1 = engine.speculator.stats()
    run.drafted += spec1["num_draft_tokens"] - spec0["num_draft_tokens"]
    run.accepted += spec1["num_accepted_tokens"] - spec0["num_accepted_tokens"]
    run.row_cost = spec1.get("row_cost", float("nan"))


def run_groups(
    ctx: BenchContext,
    arm: str,
    engine: LLMEngine,
    prompts: dict[str, list[int]],
    batch: int,
    params: SamplingParams,
) -> ArmRun:
    """One arm: ``prompts`` in groups of ``batch`` sent together, one group after another
    (``_run_group``), on an engine whose prefix cache starts empty; it ends idle and intact."""
    run = ArmRun(arm)
    # Arms share one runner, so one KV pool: a block the other engine's prefix cache names may
    # hold this one's KV by now. Each arm starts with its prefix cache empty.
    engine.reset_prefix_cache()
    meter = CpuMeter(bench_threads(ctx))
    ids = list(prompts)
    for i in range(0, len(ids), batch):
        _run_group(engine, {rid: prompts[rid] for rid in ids[i : i + batch]}, params, run)
    run.cpu_util = meter.utilisation()
    engine.check_integrity()
    assert engine.stats()["kv"]["num_used_blocks"] == 0
    assert engine.structured.active_ids() == set()
    return run
