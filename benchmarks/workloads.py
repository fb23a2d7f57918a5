"""Shared pieces of the engine benchmarks: the model, engines, prompts and per-request clocks.

Every arm of a benchmark runs in this one process with the same torch thread count, so arms
measured side by side differ only in what they are meant to compare.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from benchmarks.harness import BenchContext
from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig, cpu_count
from cluster.config.model_paths import require_model_dir
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.runner import ModelRunner
from cluster.engine.runner_registry import create_runner
from cluster.planner.workload import FIRST_PLAIN_TOKEN  # special tokens sit below it

_tiny_model_dir: Path | None = None


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
    if ctx.config.model.path is None:
        if ctx.smoke:
            return tiny_model_dir()
        from cluster.engine.models.default_model import ensure_default_model

        return ensure_default_model(ctx.config)
    return require_model_dir(ctx.config)


def tiny_model_dir() -> Path:
    """Build the tiny random Llama once per process into a temp dir (removed at exit)."""
    global _tiny_model_dir
    if _tiny_model_dir is None:
        from cluster.engine.models.tiny import build_tiny_llama

        tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-tiny-"))
        atexit.register(shutil.rmtree, tmp, True)
        _tiny_model_dir = build_tiny_llama(tmp / "model")
    return _tiny_model_dir


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


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(num_tokens)]


def exact_tokens(n: int) -> SamplingParams:
    """Greedy, EOS ignored: exactly ``n`` output tokens (what BENCHMARKS.md pins)."""
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def warm_up(engine: LLMEngine, rng: random.Random, prompt_len: int, num_tokens: int) -> None:
    """One request end to end: first-call allocations and lazy inits happen outside the clock."""
    engine.add(
        "warm-up", random_prompt(rng, prompt_len, engine.vocab_size), exact_tokens(num_tokens)
    )
    drain(engine, {})


# An arm that got less than this share of its cores shared the machine with other work. With
# torch's spinning OpenMP threads such an arm runs many times slower, not just somewhat slower.
MIN_CPU_UTIL = 0.93


def max_pair_retries(ctx: BenchContext) -> int:
    """How often a disturbed pair of long arms is run again (never in smoke: no real timing)."""
    return int(ctx.pick(2, 2, 0))


class MeteredRun(Protocol):
    cpu_util: float  # < MIN_CPU_UTIL: other work on the machine took cores during this arm


R = TypeVar("R", bound=MeteredRun)


def run_pair(
    ctx: BenchContext,
    pair: int,
    num_pairs: int,
    names: Sequence[str],
    run: Callable[[str], R],
    describe: Callable[[R], str],
    disturbed: list[dict[str, float]],
) -> dict[str, R]:
    """One pair of interleaved arms (A B on even pairs, B A on odd ones), run again at most
    ``max_pair_retries`` times while another job took cores from either arm (``disturbed``
    collects the utilizations of the pairs thrown away)."""
    for attempt in range(max_pair_retries(ctx) + 1):
        done: dict[str, R] = {}
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


_CLOCK_TICKS = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _cpu_ticks() -> list[int] | None:
    """``/proc/stat``'s machine-wide line: user nice system idle iowait irq softirq steal."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return [int(v) for v in fields[1:9]]


def machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has used since boot (``/proc/stat``: all but
    idle and iowait, steal included: a hypervisor's share is taken from us too); None where
    there is no ``/proc/stat``."""
    ticks = _cpu_ticks()
    return None if ticks is None else (sum(ticks) - ticks[3] - ticks[4]) / _CLOCK_TICKS


def machine_steal_s() -> float | None:
    """CPU seconds a hypervisor has taken from this (virtual) machine's cores since boot: time
    a core had work but ran another guest (``/proc/stat``'s steal); None where unknown."""
    ticks = _cpu_ticks()
    return None if ticks is None else ticks[7] / _CLOCK_TICKS


class StealMeter:
    """The share of this machine's core time its hypervisor took over a stretch of wall time
    (0: none; a benchmark's figures from a stretch with much of it say more about the host's
    neighbours than about the code). None where ``/proc/stat`` has no steal."""

    def __init__(
        self,
        *,
        num_cores: int | None = None,
        steal: Callable[[], float | None] = machine_steal_s,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.num_cores = num_cores if num_cores is not None else (os.cpu_count() or 1)
        self._steal_fn, self._clock = steal, clock
        self._wall, self._steal = clock(), steal()

    def share(self) -> float | None:
        wall, now = self._clock() - self._wall, self._steal_fn()
        if now is None or self._steal is None or wall <= 0:
            return None
        return max(0.0, now - self._steal) / (wall * self.num_cores)


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
