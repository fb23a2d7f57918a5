"""P8 ``routing``: prefix-aware routing of the prefill pool vs round-robin.

2 prefill replicas and 1 decode replica on one local Ray/Serve instance, remote prefill forced
(``decode.local_prefill_threshold: 0``, so the decode side's cache cannot absorb the workload).
Workload ``shared-prefix``: G groups x P prompts, each a group's S-token system prompt plus a
Q-token question, output 8 tokens, Poisson arrivals at a low rate, groups interleaved. The KV
pools hold about G/2 prefixes per replica, so round-robin (every replica sees every group)
evicts what prefix-aware routing (each group sticks to one replica) keeps.

Keys: ``hit_rate`` (prefix-aware: share of requests, each group's first excluded, whose whole
prefix came from the prefill replica's cache), ``hit_rate_rr`` (the same under round-robin),
``ttft_ratio`` (mean TTFT round-robin / prefix-aware), ``router_overhead_ms`` (p50 in-process
time from a parsed-to-be request to a routing decision: tokenize + hash + score).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

from cluster.bench.harness import BenchContext, BenchReport, percentile, summary
from cluster.bench.serve_load import (
    RequestRecord,
    WorkItem,
    local_cluster,
    poisson_offsets,
    run_load,
)
from cluster.bench.workloads import bench_model_dir

ARMS = {"prefix_aware": "cache_aware", "round_robin": "round_robin"}
OUTPUT_TOKENS = 8


def _shape(ctx: BenchContext) -> dict[str, Any]:
    return {
        "groups": ctx.pick(16, 16, 4),
        "per_group": ctx.pick(8, 4, 3),
        "prefix": ctx.pick(512, 512, 64),
        "question": ctx.pick(32, 32, 16),
        "rate": ctx.pick(1.0, 1.0, 4.0),
    }


def _workload(shape: dict[str, Any], vocab: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(8)
    prefixes = [
        [rng.randrange(1, vocab) for _ in range(shape["prefix"])] for _ in range(shape["groups"])
    ]
    items = [
        (g, prefixes[g] + [rng.randrange(1, vocab) for _ in range(shape["question"])])
        for g in range(shape["groups"])
        for _ in range(shape["per_group"])
    ]
    rng.shuffle(items)
    return items


def _config(ctx: BenchContext, arm: str, shape: dict[str, Any]) -> Any:
    block = ctx.config.cache.block_size
    blocks_per_prompt = math.ceil((shape["prefix"] + shape["question"] + OUTPUT_TOKENS) / block)
    return ctx.config.replace(
        {
            "model.path": str(bench_model_dir(ctx)),
            # Room for about G/2 prompts' prefixes per replica (plus a few in flight).
            "cache.num_blocks": (shape["groups"] // 2) * blocks_per_prompt + 4 * blocks_per_prompt,
            "prefill.num_replicas": 2,
            "decode.num_replicas": 1,
            "prefill.num_threads": 1,
            "decode.num_threads": 1,
            "prefill.num_cpus": 0.5,
            "decode.num_cpus": 0.5,
            "decode.local_prefill_threshold": 0,
            "prefill.routing.policy": ARMS[arm],
            "prefill.routing.stats_period_s": 0.5,
        }
    )


def _router_overhead_ms(
    ctx: BenchContext, cfg: Any, items: list[tuple[int, list[int]]], groups: int
) -> list[float]:
    """Tokenize + hash + score, in process, against an index holding half the groups each."""
    from cluster.common.hashing import hash_block_tokens
    from cluster.common.tokenizer import load_tokenizer
    from cluster.config.model_paths import model_limits
    from cluster.router.requests import RequestParser
    from cluster.serving.routing_policy import PrefixIndex, routing_snapshot

    tokenizer = load_tokenizer(cfg)
    block = cfg.cache.block_size
    parser = RequestParser(tokenizer, model_limits(cfg), "bench", block, cfg.router)
    index = PrefixIndex(cfg.prefill.routing, block, "prefill")
    held: dict[str, list[int]] = {"a": [], "b": []}
    for g, ids in items:
        held["a" if g < groups // 2 else "b"].extend(hash_block_tokens(ids, block))
    for rid, hashes in held.items():
        stats = routing_snapshot(hashes, kv_free=0.5, num_running=1, num_waiting=0, queued_tokens=0)
        index.update(rid, stats)
    texts = [tokenizer.decode(ids) for _, ids in items]
    for text in texts[:8]:  # warm-up
        parser.from_completion({"prompt": text, "max_tokens": OUTPUT_TOKENS})
    times = []
    for text in texts:
        t0 = time.perf_counter()
        parsed = parser.from_completion({"prompt": text, "max_tokens": OUTPUT_TOKENS})
        index.rank(["a", "b"], parsed.block_hashes, len(parsed.prompt_token_ids))
        times.append((time.perf_counter() - t0) * 1000)
    return times


def run(ctx: BenchContext) -> BenchReport:
    from cluster.config.model_paths import model_limits

    shape = _shape(ctx)
    first = _config(ctx, "prefix_aware", shape)
    vocab = model_limits(first).vocab_size
    items = _workload(shape, vocab)
    target = f"127.0.0.1:{first.router.grpc_port}"
    offsets = poisson_offsets(len(items), shape["rate"], seed=9)
    work = [WorkItem(ids, OUTPUT_TOKENS) for _, ids in items]
    warm = [WorkItem([1 + (i * 7) % (vocab - 1) for i in range(24)], 2)]
    # In-process and measured on a quiet machine, before any replica starts.
    overhead = _router_overhead_ms(ctx, first, items, shape["groups"])
    records: dict[str, list[RequestRecord]] = {}
    with local_cluster() as put:
        for arm in ARMS:
            ctx.progress(f"deploying arm {arm}")
            put(_config(ctx, arm, shape))
            asyncio.run(run_load(target, warm, [0.0]))
            ctx.progress(f"{arm}: {len(work)} requests at {shape['rate']} req/s")
            records[arm], _ = asyncio.run(run_load(target, work, offsets))
    return _report(ctx, shape, items, records, overhead)


def _report(
    ctx: BenchContext,
    shape: dict[str, Any],
    items: list[tuple[int, list[int]]],
    records: dict[str, list[RequestRecord]],
    overhead: list[float],
) -> BenchReport:
    block = ctx.config.cache.block_size
    whole_prefix = shape["prefix"] - shape["prefix"] % block
    seen: set[int] = set()
    later = []  # requests that are not their group's first (in sending order)
    for i, (g, _ids) in enumerate(items):
        if g in seen:
            later.append(i)
        seen.add(g)
    table = []
    hit_rates: dict[str, float] = {}
    mean_ttft: dict[str, float] = {}
    misses: dict[str, dict[str, int]] = {}
    for arm, recs in records.items():
        ok = [r for r in recs if r.ok]
        hits = sum(1 for i in later if recs[i].ok and recs[i].cached_tokens >= whole_prefix)
        hit_rates[arm] = hits / len(later) if later else 0.0
        misses[arm] = _classify_misses(items, recs, later, whole_prefix)
        ttfts = [r.ttft for r in ok]
        mean_ttft[arm] = sum(ttfts) / len(ttfts) if ttfts else math.nan
        s = summary(ttfts)
        table.append(
            {
                "arm": arm,
                "requests": len(recs),
                "failed": len(recs) - len(ok),
                "hit_rate": round(hit_rates[arm], 3),
                "ttft_mean": mean_ttft[arm],
                "ttft_p50": s["p50"],
                "ttft_p99": s["p99"],
            }
        )
    keys = {
        "hit_rate": hit_rates["prefix_aware"],
        "hit_rate_rr": hit_rates["round_robin"],
        "ttft_ratio": mean_ttft["round_robin"] / mean_ttft["prefix_aware"],
        "router_overhead_ms": percentile(overhead, 50),
    }
    targets = {
        "hit_rate": ">= 0.9",
        "hit_rate_rr": "(baseline)",
        "ttft_ratio": ">= 2",
        "router_overhead_ms": "p50 <= 2",
    }
    return BenchReport(
        keys=keys,
        table=table,
        targets=targets,
        details={"shape": shape, "router_overhead_ms": summary(overhead), "misses": misses},
    )


def _classify_misses(
    items: list[tuple[int, list[int]]],
    recs: list[RequestRecord],
    later: list[int],
    whole_prefix: int,
) -> dict[str, int]:
    """Why the counted requests missed: ``in_flight`` when the group's previous request had not
    produced its first token yet when this one was sent (its prefix was still being computed),
    ``lost`` otherwise (evicted, or sent to a replica that never held it), ``failed``."""
    out = {"in_flight": 0, "lost": 0, "failed": 0}
    counted = set(later)
    last_seen: dict[int, int] = {}
    for i, (g, _ids) in enumerate(items):
        prev = last_seen.get(g)
        last_seen[g] = i
        if i not in counted or (recs[i].ok and recs[i].cached_tokens >= whole_prefix):
            continue
        if not recs[i].ok:
            out["failed"] += 1
        elif prev is not None and recs[prev].ok and recs[prev].chunk_times[0] > recs[i].send:
            out["in_flight"] += 1
        else:
            out["lost"] += 1
    return out
