"""``parallel``: tensor parallelism on this host's cores (docs/benchmarks/index.md, P12).

How:
  1. ``tp2_vs_tp1_b8``: batch-8 decode of the default model (its GGUF weights, as served), two
     arms on the same cores: ``tp1``, one rank with two threads, and ``tp2``, two ranks with one
     thread each (``model.tensor_parallel_size: 2``). Each arm's engine is built once; every
     repetition submits 8 requests of 64 random prompt tokens asking for exactly ``N`` tokens
     (128; quick 48; smoke 8) and times the steps after every request has its first token
     (decode only). Arms run in an order shuffled afresh each repetition
     (``interleaved_order``); the key is the median of the per-repetition ratios tp2 / tp1
     (tok/s). Beside it: ``collective_ms_per_step_b8``, the time rank 0 spent per decode step
     waiting in the ranks' collectives (61 all-reduces and a gather per step of a 30-layer model,
     plus whatever the other rank's share of the work took longer than rank 0's).
  2. ``reshard_pull_ratio_2048``: the pull of a 2048-token prompt's KV (quick 512, smoke 64)
     from a prefill replica at TP=2 into a decode replica at TP=1, over the same pull from a
     prefill replica at TP=1 (lower is better; 1.0: re-sharding costs nothing). Both pairs of
     pool cores run in this process (``PrefillWorker`` and ``DecodeWorker``, zmq ipc), the
     decode side's prefix cache off so each prompt's blocks all move; the time is the decode
     side's receiver's ``transfer_time_s`` for that prompt's pull, streaming off
     (``transfer.stream_min_tokens: 0``: one pull once the prefill is done, so the time is
     the transfer's alone, not the prefill's it would overlap). A TP=2 replica's ranks share one
     cache holding every head, so the decode side pulls the same bytes from the same
     layout: there is no re-sharding step to pay for.

  3. ``pp2_vs_pp1_b16``: as 1, at batch 16, the arms ``pp1`` (one rank, two threads) and
     ``pp2`` (two pipeline stages of one thread each, ``model.pipeline_parallel_size: 2``, the
     step's requests in ``model.pipeline_microbatches`` micro-batches, 4 by default).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import BenchContext, BenchReport, interleaved_order
from benchmarks.workloads import bench_model_dir, exact_tokens, random_prompt
from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall, PrefillCall
from cluster.config import ClusterConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.request import EngineRequest
from cluster.engine.torch_runner import TorchModelRunner

ARMS = ("tp1", "tp2")
PP_ARMS = ("pp1", "pp2")


def _config(
    ctx: BenchContext, tp: int, pp: int = 1, overrides: dict[str, Any] | None = None
) -> ClusterConfig:
    threads = max(1, 2 // (tp * pp))
    return ctx.config.replace(
        {
            "model.path": str(bench_model_dir(ctx)),
            "model.tensor_parallel_size": tp,
            "model.pipeline_parallel_size": pp,
            "model.num_threads": threads,
            "cache.num_blocks": 1024,
            **(overrides or {}),
        }
    )


def _decode_rate(
    engine: LLMEngine, rep: int, num_tokens: int, batch: int = 8
) -> tuple[float, float]:
    """(decode tok/s, seconds rank 0 waited in collectives per decode step) of one batch."""
    rng = random.Random(rep)
    rids = [f"{rep}-{i}" for i in range(batch)]
    for rid in rids:
        prompt = random_prompt(rng, 64, engine.vocab_size)
        engine.add(EngineRequest(rid, prompt, exact_tokens(num_tokens)))
    started: set[str] = set()
    while len(started) < len(rids):  # prefill, up to every request's first token
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    runner = engine.runner
    group = runner._group if isinstance(runner, TorchModelRunner) else None
    wait0 = group.wait_s if group is not None else 0.0
    steps, tokens = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - t0
    waited = (group.wait_s - wait0) if group is not None else 0.0
    engine.check_integrity()
    return tokens / elapsed, waited / max(1, steps)


def _decode_arms(ctx: BenchContext, arms: tuple[str, str], batch: int) -> dict[str, Any]:
    """Batch-``batch`` decode of the one-rank arm ``arms[0]`` against ``arms[1]`` (two ranks:
    tensor-parallel ``tp2`` or pipelined ``pp2``), interleaved, each engine built once."""
    reps = int(ctx.pick(5, 3, 1))
    num_tokens = int(ctx.pick(128, 48, 8))
    ranks = {"tp1": (1, 1), "tp2": (2, 1), "pp1": (1, 1), "pp2": (1, 2)}
    engines = {arm: LLMEngine(_config(ctx, *ranks[arm])) for arm in arms}
    try:
        for engine in engines.values():  # warm-up: first-call allocations off the clock
            torch.set_num_threads(engine.config.model.num_threads or 1)
            _decode_rate(engine, -1, 4, batch)
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        waits: list[float] = []
        for rep in range(reps):
            for arm in interleaved_order(arms, rep):
                # torch's thread count is the process's: each arm's own before it runs
                torch.set_num_threads(engines[arm].config.model.num_threads or 1)
                rate, wait = _decode_rate(engines[arm], rep, num_tokens, batch)
                rates[arm].append(rate)
                if arm == arms[1]:
                    waits.append(wait)
                ctx.progress(f"rep {rep + 1}/{reps} {arm}: {rate:.1f} tok/s")
    finally:
        for engine in engines.values():
            engine.close()
    ratios = [b / a for a, b in zip(rates[arms[0]], rates[arms[1]], strict=True)]
    return {"rates": rates, "ratios": ratios, "wait_s": waits, "num_tokens": num_tokens}


class _InProcessPrefill:
    def __init__(self, server: Any) -> None:
        self.server = server

    def prefill(self, call: PrefillCall) -> Any:
        return self.server.prefill(call)


def _pull_s(prefill_tp: int, ctx: BenchContext, prompt_len: int, reps: int) -> list[float]:
    from cluster.decode_worker.worker import DecodeWorker
    from cluster.prefill_worker.worker import PrefillWorker

    base = _config(
        ctx,
        1,
        overrides={
            "transfer.transports": ["zmq"],
            # one pull after the prefill, not streamed while it runs: the transfer alone
            "transfer.stream_min_tokens": 0,
            "decode.local_prefill_threshold": 8,
            "scheduler.max_num_batched_tokens": 512,
            "scheduler.chunk_size": 512,
        },
    )
    prefill = PrefillWorker(
        base.replace({"prefill.tensor_parallel_size": prefill_tp, "prefill.num_threads": 1})
    ).start()
    decode_cfg = base.replace({"cache.enable_prefix_caching": False, "decode.num_threads": 1})
    decode = DecodeWorker(decode_cfg, _InProcessPrefill(prefill)).start()
    times: list[float] = []
    vocab = decode.engine.vocab_size
    try:
        for rep in range(reps + 1):  # the first pull warms the path up, off the record
            prompt = random_prompt(random.Random(1000 + rep), prompt_len, vocab)
            call = GenerateCall(f"p{rep}", prompt, hash_block_tokens(prompt, 16), exact_tokens(2))
            hist = decode.stats()["transfer"]["transfer_time_s"]
            before = (hist["sum"], hist["count"])

            async def run(c: GenerateCall = call) -> None:
                async for _ in decode.generate(c):
                    pass

            asyncio.run(run())
            hist = decode.stats()["transfer"]["transfer_time_s"]
            assert hist["count"] == before[1] + 1, "the prompt's KV did not move in one pull"
            if rep:
                times.append(hist["sum"] - before[0])
    finally:
        decode.close()
        prefill.close()
    return times


def run(ctx: BenchContext) -> BenchReport:
    ctx.progress("batch-8 decode: TP=1 x 2 threads against TP=2 x 1 thread")
    dec = _decode_arms(ctx, ARMS, 8)
    ctx.progress("batch-16 decode: one rank x 2 threads against 2 pipeline stages x 1 thread")
    pipe = _decode_arms(ctx, PP_ARMS, 16)
    prompt_len = int(ctx.pick(2048, 512, 64))
    reps = int(ctx.pick(3, 2, 1))
    ctx.progress(f"{prompt_len}-token pulls from prefill TP=1 and TP=2 into decode TP=1")
    pulls: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(reps):
        for arm in interleaved_order(("1", "2"), rep):
            pulls[int(arm)] += _pull_s(int(arm), ctx, prompt_len, 1)
    reshard = statistics.median(pulls[2]) / statistics.median(pulls[1])
    table = [{"arm": arm, "decode_tok_s_b8": statistics.median(dec["rates"][arm])} for arm in ARMS]
    table += [
        {"arm": arm, "decode_tok_s_b16": statistics.median(pipe["rates"][arm])} for arm in PP_ARMS
    ]
    table += [
        {"arm": f"pull_from_tp{tp}", f"pull_ms_{prompt_len}": statistics.median(t) * 1e3}
        for tp, t in pulls.items()
    ]
    wait_ms = statistics.median(dec["wait_s"]) * 1e3
    return BenchReport(
        keys={
            "tp2_vs_tp1_b8": statistics.median(dec["ratios"]),
            "collective_ms_per_step_b8": wait_ms,
            "reshard_pull_ratio_2048": reshard,  # (quick and smoke: shorter prompts)
            "pp2_vs_pp1_b16": statistics.median(pipe["ratios"]),
        },
        table=table,
        targets={
            "tp2_vs_tp1_b8": ">= 0.8",
            "reshard_pull_ratio_2048": "<= 1.3",
            "pp2_vs_pp1_b16": ">= 0.8",
        },
        details={
            "decode_tok_s": dec["rates"],
            "tp2_vs_tp1_per_rep": dec["ratios"],
            "collective_wait_ms_per_step": [w * 1e3 for w in dec["wait_s"]],
            "num_output_tokens": dec["num_tokens"],
            "pull_s": {f"tp{tp}": t for tp, t in pulls.items()},
            "prompt_len": prompt_len,
            "decode_tok_s_b16": pipe["rates"],
            "pp2_vs_pp1_per_rep": pipe["ratios"],
            "pipeline_microbatches": ctx.config.model.pipeline_microbatches,
        },
    )
