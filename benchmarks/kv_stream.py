"""P5 ``kv-stream``: KV streamed while prefill runs vs one bulk pull after the last chunk.

How (docs/benchmarks/index.md, P5; docs/benchmarks/index.md has the notes):
  * Ray-free pool workers in this process, on the default model: two prefill workers (one with
    ``transfer.stream_min_tokens`` at the prompt length, one with 0: bulk), one decode worker
    that prefills remotely (``decode.local_prefill_threshold`` 0) through whichever of them the
    arm names, and one decode worker without a prefill pool (the local prefill). The KV moves
    over the config's transports (default shm, pool to pool). Every engine runs 1 torch thread,
    as P1's disaggregated arm, so a pull runs on the other core while the prefill computes.
  * Arms, interleaved in an order shuffled each repetition (``harness.interleaved_order``):
    ``local`` (the decode replica prefills the prompt itself), ``bulk`` and ``stream``; every
    request is a fresh random prompt of 2,048 tokens (nothing cached anywhere), 2 output
    tokens, greedy.
  * In pdserve the first token is streamed before any KV moves (docs/architecture/index.md), so the
    transfer delays the first token the decode replica computes, not the first the client
    sees. The TTFT that counts here is therefore the time until the decode replica can decode:
    its KV is in place (remote: the pull after the first token landed; local: its own prefill
    sampled the first token), from the decode replica's request phases (one clock, one
    process). The disaggregation tax of an arm = the median over its requests of (that time -
    the prompt's compute time on the engine that prefilled it) minus the same median of the
    local arm: what the remote path adds on top of the compute (hops, the wait for the KV).
    Per request the compute is subtracted, and the decode step after it left out, because two
    2,048-token prefills measured apart differ by several times the tax on 2 shared cores;
    ``stream_compute_ratio`` (median compute time streamed / bulk) shows whether the parts
    moving during the prefill slowed it, and the JSON keeps the client's T2 (send -> second
    token) based figures too.

Keys: ``stream_tax_ratio`` (stream tax / bulk tax, <= 0.34), ``stream_compute_ratio``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import BenchContext, BenchReport, interleaved_order, summary
from benchmarks.workloads import bench_model_dir, exact_tokens
from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import (
    GenerateCall,
    PrefillCall,
    PrefillProgress,
    PrefillReply,
    StreamChunk,
)
from cluster.config import ClusterConfig
from cluster.decode_worker.worker import DecodeWorker
from cluster.planner.workload import FIRST_PLAIN_TOKEN
from cluster.prefill_worker.worker import PrefillWorker

ARMS = ("local", "bulk", "stream")
TARGETS = {"stream_tax_ratio": "<= 0.34", "stream_compute_ratio": "~1 (no slowdown)"}


class ArmPrefillClient:
    """The decode worker's prefill pool: whichever prefill worker the current arm names."""

    def __init__(self, workers: dict[str, PrefillWorker]) -> None:
        self.workers = workers
        self.arm = "bulk"

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillProgress | PrefillReply]:
        return self.workers[self.arm].prefill(call)


@dataclass
class Sample:
    arm: str
    t2_s: float  # send -> the second token (the first one the decode replica computes)
    ttft_s: float  # send -> the first token
    compute_s: float  # the prompt's prefill on the engine that ran it
    transfer_s: float  # after the first token: the pull that had to wait (bulk: all; stream: tail)
    ready_s: float  # arrival on the decode replica -> its KV in place (local: first token)
    parts: int  # pulls made while the prefill ran

    @property
    def overhead_s(self) -> float:
        """What the path adds to the compute before the decode replica can decode."""
        return self.ready_s - self.compute_s


def _shape(ctx: BenchContext) -> dict[str, Any]:
    return {
        "prompt": ctx.pick(2048, 2048, 256),
        "chunk": ctx.pick(256, 256, 32),
        "reps": ctx.pick(8, 3, 3),  # smoke: 3, so a median, not one noisy sample
        "warm_prompt": ctx.pick(512, 512, 96),
    }


def _config(ctx: BenchContext, shape: dict[str, Any]) -> ClusterConfig:
    block = ctx.config.cache.block_size
    blocks = -(-(shape["prompt"] + 4) // block) + 8
    return ctx.config.replace(
        {
            "model.path": str(bench_model_dir(ctx)),
            "model.num_threads": 1,
            "prefill.num_threads": 1,
            "decode.num_threads": 1,
            "cache.num_blocks": blocks,
            "scheduler.chunk_size": shape["chunk"],
            "decode.local_prefill_threshold": 0,
        }
    )


async def _one(decode: DecodeWorker, arm: str, prompt: list[int], block: int) -> Sample:
    rid = f"{arm}-{time.monotonic_ns()}"
    call = GenerateCall(rid, prompt, hash_block_tokens(prompt, block), exact_tokens(2))
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async for chunk in decode.generate(call):
        assert isinstance(chunk, StreamChunk)  # nothing drains this replica: no Migrating
        if chunk.token_ids:
            times.extend([time.perf_counter()] * len(chunk.token_ids))
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and len(times) >= 2, f"{arm}: the request did not finish"
    expected = "local" if arm == "local" else "remote"
    if usage.prefill_mode != expected:
        raise RuntimeError(f"{arm}: prefilled {usage.prefill_mode}, expected {expected}")
    phases = usage.phases
    # Remote: decode_queue_ms runs from arrival to the final pull's start (the first token and
    # the reservation in hand), transfer_ms is that pull; local: queue, then its own prefill.
    after_queue = phases["transfer_ms"] if arm != "local" else phases["prefill_ms"]
    return Sample(
        arm=arm,
        t2_s=times[1] - t0,
        ttft_s=times[0] - t0,
        compute_s=phases["prefill_ms"] / 1000,
        transfer_s=phases["transfer_ms"] / 1000,
        ready_s=(phases["decode_queue_ms"] + after_queue) / 1000,
        parts=0,
    )


class _Workers:
    """The arms' workers: a bulk and a streaming prefill worker behind one remote decode worker
    (``ArmPrefillClient`` picks the arm's), and a decode worker that prefills locally."""

    def __init__(self, cfg: ClusterConfig, shape: dict[str, Any]) -> None:
        self.block = cfg.cache.block_size
        self.prefills = {
            "bulk": PrefillWorker(cfg.replace({"transfer.stream_min_tokens": 0})).start(),
            "stream": PrefillWorker(
                cfg.replace({"transfer.stream_min_tokens": shape["prompt"]})
            ).start(),
        }
        self.client = ArmPrefillClient(self.prefills)
        self.remote = DecodeWorker(cfg, self.client).start()
        self.local = DecodeWorker(cfg, None).start()
        self.rng = random.Random(5)
        self.vocab = _vocab(cfg)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_PLAIN_TOKEN, self.vocab) for _ in range(n)]

    async def measure(self, arm: str, n: int) -> Sample:
        if arm == "local":
            return await _one(self.local, arm, self.prompt(n), self.block)
        self.client.arm = arm
        parts_before = self.remote.counters["streamed_parts"]
        s = await _one(self.remote, arm, self.prompt(n), self.block)
        s.parts = self.remote.counters["streamed_parts"] - parts_before
        return s

    def stats(self) -> dict[str, Any]:
        return {
            "decode_transfer": self.remote.receiver.stats(),
            "prefill_stream": self.prefills["stream"].sender.stats(),
            "prefill_bulk": self.prefills["bulk"].sender.stats(),
        }

    def check_integrity(self) -> None:
        for w in (self.remote, self.local):
            w.engine.check_integrity()
        for p in self.prefills.values():
            p.engine.check_integrity()

    def close(self) -> None:
        self.remote.close()
        self.local.close()
        for p in self.prefills.values():
            p.close()


async def _samples(ctx: BenchContext, workers: _Workers, shape: dict[str, Any]) -> list[Sample]:
    """A warm-up request per arm (first calls, lazy inits, the stream path end to end), then
    the repetitions, the arms in a shuffled order each time."""
    for arm in ARMS:
        await workers.measure(arm, shape["warm_prompt"])
    samples: list[Sample] = []
    for rep in range(shape["reps"]):
        for arm in interleaved_order(ARMS, rep):
            s = await workers.measure(arm, shape["prompt"])
            samples.append(s)
            ctx.progress(
                f"rep {rep + 1}/{shape['reps']} {arm}: T2 {s.t2_s:.3f} s, compute "
                f"{s.compute_s:.3f} s, overhead {s.overhead_s * 1e3:.1f} ms, wait for KV "
                f"{s.transfer_s * 1e3:.1f} ms, parts {s.parts}"
            )
    return samples


def run(ctx: BenchContext) -> BenchReport:
    shape = _shape(ctx)
    cfg = _config(ctx, shape)
    ctx.progress(f"starting 4 workers ({cfg.transfer.transports}, chunk {shape['chunk']})")
    workers = _Workers(cfg, shape)
    try:
        samples = asyncio.run(_samples(ctx, workers, shape))
        stats = workers.stats()
        workers.check_integrity()
    finally:
        workers.close()
    return _report(shape, cfg, samples, stats)


def _vocab(cfg: ClusterConfig) -> int:
    from cluster.config.model_paths import model_limits

    return model_limits(cfg).vocab_size


def _report(
    shape: dict[str, Any], cfg: ClusterConfig, samples: list[Sample], stats: dict[str, Any]
) -> BenchReport:
    by_arm = {arm: [s for s in samples if s.arm == arm] for arm in ARMS}
    med = {arm: statistics.median(s.overhead_s for s in ss) for arm, ss in by_arm.items()}
    compute = {arm: statistics.median(s.compute_s for s in ss) for arm, ss in by_arm.items()}
    t2 = {arm: statistics.median(s.t2_s for s in ss) for arm, ss in by_arm.items()}
    tax = {arm: med[arm] - med["local"] for arm in ("bulk", "stream")}
    keys = {
        "stream_tax_ratio": tax["stream"] / tax["bulk"] if tax["bulk"] > 0 else float("inf"),
        "stream_compute_ratio": compute["stream"] / compute["bulk"],
    }
    table = [
        {
            "arm": arm,
            "n": len(ss),
            "T2_ms": t2[arm] * 1e3,
            "ttft_ms": statistics.median(s.ttft_s for s in ss) * 1e3,
            "compute_ms": compute[arm] * 1e3,
            "overhead_ms": med[arm] * 1e3,
            "tax_ms": (med[arm] - med["local"]) * 1e3,
            "kv_wait_ms": statistics.median(s.transfer_s for s in ss) * 1e3,
            "parts": statistics.median(s.parts for s in ss),
        }
        for arm, ss in by_arm.items()
    ]
    return BenchReport(
        keys=keys,
        table=table,
        targets=TARGETS,
        details={
            "shape": shape,
            "transports": list(cfg.transfer.transports),
            "tax_ms": {a: v * 1e3 for a, v in tax.items()},
            # The literal definition (median T2 minus the local arm's), for comparison: the
            # compute's run-to-run spread sits in it.
            "direct_tax_ms": {a: (t2[a] - t2["local"]) * 1e3 for a in ("bulk", "stream")},
            "t2_overhead_tax_ms": {
                a: (
                    statistics.median(s.t2_s - s.compute_s for s in by_arm[a])
                    - statistics.median(s.t2_s - s.compute_s for s in by_arm["local"])
                )
                * 1e3
                for a in ("bulk", "stream")
            },
            "overhead_s": {a: summary([s.overhead_s for s in ss]) for a, ss in by_arm.items()},
            "compute_s": {a: summary([s.compute_s for s in ss]) for a, ss in by_arm.items()},
            "samples": [s.__dict__ for s in samples],
            "stats": stats,
        },
    )
