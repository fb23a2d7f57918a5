"""P3 ``prefix``: the prefix cache.

How (docs/benchmarks/index.md, P3):
  1. 10 prefixes of 512 random tokens; each request is a prefix + a fresh 32-token suffix and
     asks for 8 tokens; 5 requests per prefix (quick 3), shuffled (seed 0), sent one at a time
     (each runs to completion before the next is sent). The first request of each prefix in the
     shuffled order is a miss, the others hit the 512 cached tokens (32 full blocks).
  2. After (or before: the order alternates) every miss, HF runs one forward of the same prompt
     (``logits_to_keep=1`` as ``generate``'s prefill), the work a first token costs there.
  3. No-share arm: prompts of the same length sharing nothing, each sent once to an engine with
     caching on and once to one with caching off (alternating which goes first). Both engines
     share one runner, so the two arms use the same weights in the same memory.
  The engine's default scheduler (``chunk_size`` 256: a 544-token miss is prefilled in 3 chunks)
  is used throughout, as a deployment would run it.

TTFT = send -> the step return that carries the first token. Keys: ``ttft_speedup`` (median miss
TTFT / median hit TTFT), ``miss_vs_hf`` (median over misses of our TTFT / the HF forward of the
same prompt), ``no_share_regression`` (median over pairs of TTFT caching on / off).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import BenchContext, BenchReport, summary
from benchmarks.hf_reference import forward_time, load_hf_model
from benchmarks.workloads import (
    bench_model_dir,
    drain,
    exact_tokens,
    make_engine,
    make_runner,
    pin_threads,
    random_prompt,
    warm_up,
)
from cluster.engine.engine import EngineRequest, LLMEngine


def send_one(engine: LLMEngine, rid: str, prompt: list[int], num_tokens: int) -> tuple[float, int]:
    """Run one request alone to completion; returns (TTFT seconds, prompt tokens from cache)."""
    t0 = time.perf_counter()
    engine.add(EngineRequest(rid, prompt, exact_tokens(num_tokens)))
    while True:
        outputs = engine.step()
        now = time.perf_counter()
        mine = [o for o in outputs if o.request_id == rid and o.new_token_ids]
        if mine:
            ttft, cached = now - t0, mine[0].num_cached_tokens
            break
    drain(engine, {})
    return ttft, cached


@dataclass(frozen=True)
class _Shape:
    num_prefixes: int
    per_prefix: int  # requests per prefix
    prefix_len: int
    suffix_len: int
    num_out: int
    num_no_share: int  # pairs of no-share prompts

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len


@dataclass
class _Shared:
    """The shared-prefix workload's TTFTs: misses (with the HF forward of the same prompt)
    and hits."""

    miss_ttft: list[float] = field(default_factory=list)
    hit_ttft: list[float] = field(default_factory=list)
    hf_ttft: list[float] = field(default_factory=list)
    miss_vs_hf: list[float] = field(default_factory=list)
    cached_on_hits: list[int] = field(default_factory=list)


def _shared_prefix(
    ctx: BenchContext, on: LLMEngine, hf: Any, rng: random.Random, shape: _Shape
) -> _Shared:
    """The shared-prefix workload, with an HF forward paired with each miss (before our request
    on every other miss, after it on the rest)."""
    vocab = on.vocab_size
    prefixes = [random_prompt(rng, shape.prefix_len, vocab) for _ in range(shape.num_prefixes)]
    order = [g for g in range(shape.num_prefixes) for _ in range(shape.per_prefix)]
    rng.shuffle(order)
    seen: set[int] = set()
    out = _Shared()
    for i, g in enumerate(order):
        prompt = prefixes[g] + random_prompt(rng, shape.suffix_len, vocab)
        is_miss = g not in seen
        seen.add(g)
        hf_first = is_miss and len(out.miss_ttft) % 2 == 1
        hf_s = forward_time(hf, prompt) if hf_first else 0.0
        ttft, cached = send_one(on, f"p{g}-{i}", prompt, shape.num_out)
        if is_miss:
            hf_s = hf_s or forward_time(hf, prompt)
            assert cached == 0, f"first request of prefix {g} hit {cached} cached tokens"
            out.miss_ttft.append(ttft)
            out.hf_ttft.append(hf_s)
            out.miss_vs_hf.append(ttft / hf_s)
        else:
            out.cached_on_hits.append(cached)
            out.hit_ttft.append(ttft)
        kind = "miss" if is_miss else f"hit ({cached} cached)"
        hf_note = f", HF forward {1e3 * hf_s:.0f} ms" if is_miss else ""
        ctx.progress(
            f"request {i + 1}/{len(order)} prefix {g} {kind}: TTFT {1e3 * ttft:.0f} ms{hf_note}"
        )
    return out


def _no_share(
    ctx: BenchContext,
    arms: dict[str, LLMEngine],
    rng: random.Random,
    shape: _Shape,
) -> tuple[list[float], dict[str, list[float]]]:
    """Prompts that share nothing, caching on vs off (pairs, the order alternating): the
    ratios per pair and each arm's TTFTs."""
    share_ratios: list[float] = []
    ttft_arm: dict[str, list[float]] = {"on": [], "off": []}
    for k in range(shape.num_no_share):
        prompt = random_prompt(rng, shape.prompt_len, arms["on"].vocab_size)
        for name in ("on", "off") if k % 2 == 0 else ("off", "on"):
            ttft, cached = send_one(arms[name], f"ns{k}-{name}", prompt, shape.num_out)
            assert cached == 0, "a no-share prompt hit the cache"
            ttft_arm[name].append(ttft)
        share_ratios.append(ttft_arm["on"][-1] / ttft_arm["off"][-1])
        ctx.progress(
            f"no-share pair {k + 1}/{shape.num_no_share}: caching on "
            f"{1e3 * ttft_arm['on'][-1]:.0f} ms, off {1e3 * ttft_arm['off'][-1]:.0f} ms"
        )
    return share_ratios, ttft_arm


def _row(name: str, values: list[float]) -> dict[str, Any]:
    s = summary(values)
    return {
        "arm": name,
        "n": len(values),
        "ttft_mean_ms": 1e3 * s["mean"],
        "ttft_p50_ms": 1e3 * s["p50"],
        "ttft_p90_ms": 1e3 * s["p90"],
    }


def run(ctx: BenchContext) -> BenchReport:
    shape = _Shape(
        num_prefixes=ctx.pick(10, 10, 2),
        per_prefix=ctx.pick(5, 3, 2),
        prefix_len=ctx.pick(512, 512, 64),
        suffix_len=ctx.pick(32, 32, 8),
        num_out=ctx.pick(8, 8, 2),
        num_no_share=ctx.pick(10, 6, 2),
    )
    ctx.progress("loading our runner and the HF reference")
    threads = pin_threads(ctx)
    runner = make_runner(ctx)
    on = make_engine(ctx, {"cache.enable_prefix_caching": True}, runner=runner)
    off = make_engine(ctx, {"cache.enable_prefix_caching": False}, runner=runner)
    hf = load_hf_model(bench_model_dir(ctx))
    pin_threads(ctx)
    rng = random.Random(0)
    warm_up(on, rng, shape.prompt_len, 1)
    warm_up(off, rng, 16, 1)
    forward_time(hf, random_prompt(rng, shape.prompt_len, runner.vocab_size))
    shared = _shared_prefix(ctx, on, hf, rng, shape)
    share_ratios, ttft_arm = _no_share(ctx, {"on": on, "off": off}, rng, shape)
    on.check_integrity()
    off.check_integrity()
    return BenchReport(
        keys={
            "ttft_speedup": statistics.median(shared.miss_ttft)
            / statistics.median(shared.hit_ttft),
            "miss_vs_hf": statistics.median(shared.miss_vs_hf),
            "no_share_regression": statistics.median(share_ratios),
        },
        table=[
            _row("miss (ours)", shared.miss_ttft),
            _row("hit (ours)", shared.hit_ttft),
            _row("HF forward, miss prompts", shared.hf_ttft),
            _row("no-share, caching on", ttft_arm["on"]),
            _row("no-share, caching off", ttft_arm["off"]),
        ],
        targets={"ttft_speedup": ">= 8", "miss_vs_hf": "<= 1.1", "no_share_regression": "<= 1.03"},
        details={
            "threads": threads,
            "chunk_size": on.config.scheduler.chunk_size,
            "prefix_len": shape.prefix_len,
            "suffix_len": shape.suffix_len,
            "num_output_tokens": shape.num_out,
            "num_prefixes": shape.num_prefixes,
            "requests_per_prefix": shape.per_prefix,
            "cached_tokens_on_hits": summary([float(c) for c in shared.cached_on_hits]),
            "miss_ttft_s": shared.miss_ttft,
            "hit_ttft_s": shared.hit_ttft,
            "hf_forward_s": shared.hf_ttft,
            "miss_vs_hf_per_miss": shared.miss_vs_hf,
            "no_share_ratio_per_pair": share_ratios,
            "ttft_speedup_means": statistics.fmean(shared.miss_ttft)
            / statistics.fmean(shared.hit_ttft),
        },
    )
