"""P2 ``engine``: continuous batching (ours) vs static batching (transformers ``generate``).

How (docs/benchmarks/index.md, P2):
  1. Workload, seed 0: N requests (64; quick 16), prompt lengths U(32, 256) of random token ids,
     output lengths U(16, 256), all submitted at t=0, greedy with EOS ignored (every request
     produces exactly the tokens it asked for).
  2. Ours: a fresh ``LLMEngine`` (default scheduler: continuous batching, chunked prefill) per
     run, sharing one runner (the same weights) so no run sees another's prefix cache. E2EL of a
     request = the step return that produced its last token, from t=0.
  3. HF: ``generate`` (sdpa, KV cache, left padding) on static batches of 8 in arrival order,
     each batch run to its longest request; a request's E2EL = when its batch finished.
  4. Arms alternate (ours HF, HF ours, ...); ratios are per pair, the median reported. A pair
     in which an arm got < 93% of its cores (another job on the shared machine) is run again,
     at most twice.

Keys: ``throughput_ratio`` (output tok/s ours / HF, counting only the tokens each request asked
for; padding steps of HF's shorter rows are not counted), ``e2el_ratio`` (HF mean E2EL / ours).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import ArmRun, BenchContext, BenchReport, summary
from benchmarks.hf_reference import generate_exact, load_hf_model
from benchmarks.workloads import (
    CpuMeter,
    Timeline,
    bench_model_dir,
    bench_threads,
    drain,
    exact_tokens,
    make_engine,
    make_runner,
    pin_threads,
    random_prompt,
    run_pair,
    warm_up,
)
from cluster.engine.request import EngineRequest
from cluster.engine.runner import ModelRunner


@dataclass(frozen=True)
class PromptBatch:
    """P2's requests, all submitted at t=0: each prompt and the exact output length it asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int
) -> PromptBatch:
    rng = random.Random(0)
    prompt_lens = [rng.randint(*prompt_range) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    prompts = [random_prompt(rng, n, vocab) for n in prompt_lens]
    return PromptBatch(prompts, output_lens)


def run_ours(ctx: BenchContext, runner: ModelRunner, w: PromptBatch) -> ArmRun:
    engine = make_engine(ctx, runner=runner)
    warm_up(engine, random.Random(1), 16, 2)
    meter = CpuMeter(bench_threads(ctx))
    t0 = time.perf_counter()
    arrival = time.monotonic()
    timelines = {}
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens)):
        rid = f"req-{i}"
        engine.add(EngineRequest(rid, prompt, exact_tokens(n), arrival_time=arrival))
        timelines[rid] = Timeline(send=t0)
    drain(engine, timelines)
    engine.check_integrity()
    for tl, n in zip(timelines.values(), w.output_lens):
        assert tl.finished and len(tl.token_times) == n, "a request did not get its tokens"
    e2el = [tl.e2el for tl in timelines.values()]
    return ArmRun(
        "ours",
        meter.utilisation(),
        duration_s=max(e2el),
        e2el_s=e2el,
        ttft_s=[tl.ttft for tl in timelines.values()],
        num_preemptions=int(engine.stats()["num_preemptions"]),
    )


def run_hf(model: Any, w: PromptBatch, batch_size: int, threads: int) -> ArmRun:
    meter = CpuMeter(threads)
    t0 = time.perf_counter()
    e2el: list[float] = []
    for start in range(0, len(w.prompts), batch_size):
        prompts = w.prompts[start : start + batch_size]
        longest = max(w.output_lens[start : start + batch_size])
        generate_exact(model, prompts, longest)
        e2el.extend([time.perf_counter() - t0] * len(prompts))
    return ArmRun("hf_static_batch", meter.utilisation(), duration_s=e2el[-1], e2el_s=e2el)


def run(ctx: BenchContext) -> BenchReport:
    num_requests = ctx.pick(64, 16, 8)
    num_pairs = ctx.pick(2, 1, 1)
    hf_batch = ctx.pick(8, 8, 4)
    prompt_range = ctx.pick((32, 256), (32, 256), (8, 32))
    output_range = ctx.pick((16, 256), (16, 256), (4, 16))
    ctx.progress("loading our runner and the HF reference")
    threads = pin_threads(ctx)
    runner = make_runner(ctx)
    hf = load_hf_model(bench_model_dir(ctx))
    pin_threads(ctx)
    w = make_workload(num_requests, prompt_range, output_range, runner.vocab_size)
    generate_exact(hf, w.prompts[:2], 2)  # warm-up
    ctx.progress(
        f"{num_requests} requests, {w.num_output_tokens} output tokens; {num_pairs} pair(s)"
    )

    runs: list[tuple[ArmRun, ArmRun]] = []
    disturbed: list[dict[str, float]] = []  # pairs run again: another job took cores
    for pair in range(num_pairs):
        arms = run_pair(
            ctx,
            pair,
            num_pairs,
            ("ours", "hf"),
            lambda arm: (
                run_ours(ctx, runner, w) if arm == "ours" else run_hf(hf, w, hf_batch, threads)
            ),
            lambda r: (
                f"{r.duration_s:.1f} s, {r.tok_s(w.num_output_tokens):.1f} tok/s, mean E2EL "
                f"{statistics.fmean(r.e2el_s):.2f} s, cpu util {r.cpu_util:.2f}"
            ),
            disturbed,
        )
        runs.append((arms["ours"], arms["hf"]))

    tput = [o.tok_s(w.num_output_tokens) / h.tok_s(w.num_output_tokens) for o, h in runs]
    e2el = [statistics.fmean(h.e2el_s) / statistics.fmean(o.e2el_s) for o, h in runs]
    table = []
    for pair, (o, h) in enumerate(runs):
        for r in (o, h):
            s = summary(r.e2el_s)
            table.append(
                {
                    "pair": pair + 1,
                    "arm": r.arm,
                    "duration_s": r.duration_s,
                    "output_tok_s": r.tok_s(w.num_output_tokens),
                    "e2el_mean_s": s["mean"],
                    "e2el_p50_s": s["p50"],
                    "e2el_p99_s": s["p99"],
                    "ttft_mean_s": statistics.fmean(r.ttft_s) if r.ttft_s else "",
                    "cpu_util": r.cpu_util,
                }
            )
    return BenchReport(
        keys={"throughput_ratio": statistics.median(tput), "e2el_ratio": statistics.median(e2el)},
        table=table,
        targets={"throughput_ratio": ">= 2.5", "e2el_ratio": ">= 2"},
        details={
            "threads": threads,
            "num_requests": num_requests,
            "num_output_tokens": w.num_output_tokens,
            "num_prompt_tokens": sum(map(len, w.prompts)),
            "hf_batch_size": hf_batch,
            "throughput_ratio_per_pair": tput,
            "e2el_ratio_per_pair": e2el,
            "disturbed_pairs_rerun": disturbed,
            "ours": [
                {
                    "e2el": summary(o.e2el_s),
                    "ttft": summary(o.ttft_s),
                    "num_preemptions": o.num_preemptions,
                }
                for o, _ in runs
            ],
            "hf": [{"e2el": summary(h.e2el_s)} for _, h in runs],
        },
    )
