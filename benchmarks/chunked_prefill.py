"""P7 ``chunked-prefill``: stall-free decoding while long prompts arrive.

How (docs/benchmarks/index.md, P7):
  1. 16 requests (128-token random prompts, 256 output tokens, greedy, EOS ignored) are sent
     together; once all have their first token, every later engine step is a decode step of
     theirs, counted 1, 2, ...
  2. Four 1024-token prompts (32 output tokens each, the long class of ``mixed-long``) are sent
     just before decode steps 32, 80, 128 and 176.
  3. Arms: no chunking (``chunk_size`` null, ``max_num_batched_tokens`` = max_model_len as the
     config demands: a long prompt is prefilled in one step, all decodes wait for it) vs chunk
     128 (default budget 2048: the prompt is spread over 8 steps, each still carrying the
     decodes). Each run gets a fresh engine on one shared runner; arms alternate, ratios are
     per pair, the median reported. A pair in which an arm got < 93% of its cores (another job
     on the shared machine) is run again, at most twice.

ITL = gap between two consecutive step returns that gave a decode request a token, pooled over
the 16 decodes. Keys: ``p99_itl_ratio`` (p99 ITL no chunking / chunk 128), ``long_ttft_cost``
(mean TTFT of the long prompts, chunked / unchunked).
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import ArmRun, BenchContext, BenchReport, percentile, summary
from benchmarks.workloads import (
    CpuMeter,
    Timeline,
    bench_threads,
    drain,
    exact_tokens,
    make_engine,
    make_runner,
    pin_threads,
    random_prompt,
    record,
    run_pair,
    warm_up,
)
from cluster.engine.request import EngineRequest
from cluster.engine.runner import ModelRunner


@dataclass(frozen=True)
class Shape:
    num_decodes: int
    decode_prompt_len: int
    decode_output_len: int
    long_prompt_len: int
    long_output_len: int
    arrival_steps: tuple[int, ...]


def _run_named_arm(
    ctx: BenchContext,
    runner: ModelRunner,
    arms: dict[str, dict[str, Any]],
    shape: Shape,
    decode_prompts: list[list[int]],
    long_prompts: list[list[int]],
    name: str,
) -> ArmRun:
    return run_arm(ctx, runner, name, arms[name], shape, decode_prompts, long_prompts)


def run_arm(
    ctx: BenchContext,
    runner: ModelRunner,
    arm: str,
    overrides: dict[str, Any],
    shape: Shape,
    decode_prompts: list[list[int]],
    long_prompts: list[list[int]],
) -> ArmRun:
    engine = make_engine(ctx, overrides, runner=runner)
    warm_up(engine, random.Random(1), 16, 2)
    decodes: dict[str, Timeline] = {}
    meter = CpuMeter(bench_threads(ctx))
    t0 = time.perf_counter()
    for i, prompt in enumerate(decode_prompts):
        rid = f"decode-{i}"
        engine.add(EngineRequest(rid, prompt, exact_tokens(shape.decode_output_len)))
        decodes[rid] = Timeline(send=t0)
    longs: dict[str, Timeline] = {}
    timelines: dict[str, Timeline] = dict(decodes)
    while not all(tl.token_times for tl in decodes.values()):  # the decodes' prefill
        record(engine.step(), timelines, time.perf_counter())
    arrivals = dict(zip(shape.arrival_steps, long_prompts))
    step = 0
    while not all(tl.finished for tl in decodes.values()):
        step += 1
        arriving = arrivals.get(step)
        if arriving is not None:
            rid = f"long-{len(longs)}"
            engine.add(EngineRequest(rid, arriving, exact_tokens(shape.long_output_len)))
            longs[rid] = timelines[rid] = Timeline(send=time.perf_counter())
        record(engine.step(), timelines, time.perf_counter())
    drain(engine, timelines)
    duration = time.perf_counter() - t0
    engine.check_integrity()
    assert len(longs) == len(long_prompts), "the decodes ended before every long prompt arrived"
    return ArmRun(
        arm,
        meter.utilisation(),
        duration_s=duration,
        # the decodes' gaps and TPOTs; the long prompts' TTFTs
        itl_s=[gap for tl in decodes.values() for gap in tl.itls],
        tpot_s=[(tl.e2el - tl.ttft) / (len(tl.token_times) - 1) for tl in decodes.values()],
        ttft_s=[tl.ttft for tl in longs.values()],
    )


def plot_itl_cdf(path: Path, runs: list[ArmRun]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in dict.fromkeys(r.arm for r in runs):
        xs = sorted(1e3 * g for r in runs if r.arm == arm for g in r.itl_s)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency of the running decodes (ms)")
    ax.set_ylabel("CDF")
    ax.set_title("P7 chunked-prefill: ITL while 1024-token prompts arrive")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(ctx: BenchContext) -> BenchReport:
    shape = Shape(
        num_decodes=ctx.pick(16, 16, 4),
        decode_prompt_len=ctx.pick(128, 128, 16),
        decode_output_len=ctx.pick(256, 256, 40),
        long_prompt_len=ctx.pick(1024, 1024, 96),
        long_output_len=ctx.pick(32, 32, 4),
        arrival_steps=ctx.pick((32, 80, 128, 176), (32, 80, 128, 176), (8, 20)),
    )
    chunk = ctx.pick(128, 128, 16)
    num_pairs = ctx.pick(3, 1, 1)
    ctx.progress("loading the runner")
    threads = pin_threads(ctx)
    runner = make_runner(ctx)
    arms: dict[str, dict[str, Any]] = {
        "no_chunking": {
            "scheduler.chunk_size": None,
            "scheduler.max_num_batched_tokens": max(
                runner.max_model_len, ctx.config.scheduler.max_num_batched_tokens
            ),
        },
        f"chunk_{chunk}": {"scheduler.chunk_size": chunk},
    }
    names = list(arms)
    rng = random.Random(0)
    vocab = runner.vocab_size
    runs: list[tuple[ArmRun, ArmRun]] = []
    disturbed: list[dict[str, float]] = []  # pairs run again: another job took cores
    for pair in range(num_pairs):
        decode_prompts = [
            random_prompt(rng, shape.decode_prompt_len, vocab) for _ in range(shape.num_decodes)
        ]
        long_prompts = [
            random_prompt(rng, shape.long_prompt_len, vocab) for _ in shape.arrival_steps
        ]
        done = run_pair(
            ctx,
            pair,
            num_pairs,
            names,
            functools.partial(
                _run_named_arm, ctx, runner, arms, shape, decode_prompts, long_prompts
            ),
            lambda r: (
                f"p99 ITL {1e3 * percentile(r.itl_s, 99):.0f} ms, long TTFT "
                f"{1e3 * statistics.fmean(r.ttft_s):.0f} ms, {r.duration_s:.1f} s, "
                f"cpu util {r.cpu_util:.2f}"
            ),
            disturbed,
        )
        runs.append((done[names[0]], done[names[1]]))

    itl_ratio = [percentile(u.itl_s, 99) / percentile(c.itl_s, 99) for u, c in runs]
    ttft_cost = [statistics.fmean(c.ttft_s) / statistics.fmean(u.ttft_s) for u, c in runs]
    table = []
    for pair, arm_runs in enumerate(runs):
        for r in arm_runs:
            s = summary(r.itl_s)
            table.append(
                {
                    "pair": pair + 1,
                    "arm": r.arm,
                    "itl_p50_ms": 1e3 * s["p50"],
                    "itl_p90_ms": 1e3 * s["p90"],
                    "itl_p99_ms": 1e3 * s["p99"],
                    "itl_max_ms": 1e3 * max(r.itl_s),
                    "tpot_mean_ms": 1e3 * statistics.fmean(r.tpot_s),
                    "long_ttft_mean_ms": 1e3 * statistics.fmean(r.ttft_s),
                    "duration_s": r.duration_s,
                    "cpu_util": r.cpu_util,
                }
            )
    files: list[str] = []
    if not ctx.smoke:
        png = ctx.results_dir / f"{ctx.name}_itl_cdf.png"
        ctx.results_dir.mkdir(parents=True, exist_ok=True)
        plot_itl_cdf(png, [r for pair_runs in runs for r in pair_runs])
        files.append(str(png))
    return BenchReport(
        keys={
            "p99_itl_ratio": statistics.median(itl_ratio),
            "long_ttft_cost": statistics.median(ttft_cost),
        },
        table=table,
        targets={"p99_itl_ratio": ">= 4", "long_ttft_cost": "<= 1.2"},
        details={
            "threads": threads,
            "shape": shape.__dict__,
            "arms": arms,
            "p99_itl_ratio_per_pair": itl_ratio,
            "long_ttft_cost_per_pair": ttft_cost,
            "long_ttft_s": {r.arm: r.ttft_s for pair_runs in runs for r in pair_runs},
            "num_itls_per_arm": len(runs[0][0].itl_s),
            "disturbed_pairs_rerun": disturbed,
        },
        files=files,
    )
