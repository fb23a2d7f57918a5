"""Load generation and client-side metrics for P1 (as vLLM's and SGLang's serving benchmarks).

Measured at the client over gRPC streaming:
  TTFT  send -> first non-empty chunk;  ITL  gaps between consecutive chunks, pooled;
  TPOT  per request (E2EL - TTFT) / (output tokens - 1);  E2EL  send -> last byte.
Goodput counts requests that meet every SLO (TTFT and TPOT) per second of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.bench.harness import summary


@dataclass
class RequestRecord:
    prompt_len: int
    max_tokens: int
    send: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (the final usage)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.send

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(frozen=True)
class WorkItem:
    token_ids: list[int]
    max_tokens: int


def mixed_long(num: int, vocab_size: int, seed: int, scale: float = 1.0) -> list[WorkItem]:
    """BENCHMARKS.md ``mixed-long``: 80% chat (64-128 in / 64 out), 20% long (768-1024 / 32).

    ``scale`` shrinks every length (smoke runs on tiny models)."""
    rng = random.Random(seed)
    items = []
    for _ in range(num):
        if rng.random() < 0.8:
            n_in, n_out = rng.randint(64, 128), 64
        else:
            n_in, n_out = rng.randint(768, 1024), 32
        n_in, n_out = max(2, int(n_in * scale)), max(2, int(n_out * scale))
        items.append(WorkItem([rng.randrange(17, vocab_size) for _ in range(n_in)], n_out))
    return items


def poisson_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s from start) for a Poisson process (gamma, burstiness 1)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return out


async def run_load(
    target: str, items: Sequence[WorkItem], offsets: Sequence[float], timeout_s: float = 600.0
) -> tuple[list[RequestRecord], float]:
    """Send each item at its offset over gRPC; returns the records and the run's duration."""
    import grpc

    from cluster.pb.pdserve.v1 import generation_pb2 as pb
    from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(item: WorkItem, offset: float) -> RequestRecord:
            rec = RequestRecord(len(item.token_ids), item.max_tokens)
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=item.token_ids),
                sampling=pb.SamplingParameters(
                    max_tokens=item.max_tokens,
                    min_tokens=item.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                ),
            )
            rec.send = time.perf_counter()
            try:
                async for msg in stub.Generate(req, timeout=timeout_s):
                    if msg.token_ids or msg.text:
                        rec.chunk_times.append(time.perf_counter())
                        rec.output_tokens += len(msg.token_ids)
                    if msg.HasField("usage"):
                        rec.cached_tokens = msg.usage.cached_tokens
            except grpc.aio.AioRpcError as e:
                rec.error = f"{e.code().name}: {e.details()}"
            return rec

        records = await asyncio.gather(*(one(i, o) for i, o in zip(items, offsets)))
        return list(records), time.perf_counter() - start


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    e2els = [r.e2el for r in ok]
    itls = [g for r in ok for g in r.itls]
    good = 0
    if ttft_slo_s is not None and tpot_slo_s is not None:
        for r in ok:
            tpot = r.tpot
            if r.ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s):
                good += 1
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": sum(min(r.output_tokens, r.max_tokens) for r in ok) / duration_s
        if duration_s > 0
        else 0.0,
        "goodput": good / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": good / len(records) if records else 0.0,
        "ttft_s": summary(ttfts),
        "tpot_s": summary(tpots),
        "itl_s": summary(itls),
        "e2el_s": summary(e2els),
    }


@contextlib.contextmanager
def local_cluster() -> Iterator[Callable[[Any], None]]:
    """Deploy benchmark arms one after another on one local Ray/Serve instance: the first call
    starts it, later ones redeploy the app, and leaving the block shuts it down."""
    from cluster.serve_main import deploy, start

    started = False

    def put(cfg: Any) -> None:
        nonlocal started
        if started:
            deploy(cfg)
        else:
            start(cfg, metrics_port=None)
            started = True

    try:
        yield put
    finally:
        if started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
