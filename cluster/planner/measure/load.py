"""Load generation and client-side metrics (as vLLM's and SGLang's serving benchmarks).

Measured at the client over gRPC streaming:
  TTFT  send -> first non-empty chunk;  ITL  gaps between consecutive chunks, pooled;
  TPOT  per request (E2EL - TTFT) / (output tokens - 1);  E2EL  send -> last byte.
Goodput counts requests that meet every SLO of their prompt-length class (TTFT and TPOT) per
second of the run. Workloads, arrivals, SLOs and the metric code are the planner's
(``cluster.planner.workload``, ``cluster.planner.metrics``): the simulator's predictions and
these measurements are read the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.common.protocol import PHASES
from cluster.planner.metrics import slo_metrics, summary
from cluster.planner.workload import SLOs, WorkItem


@dataclass
class RequestRecord:
    prompt_len: int
    max_tokens: int
    cls: str = ""  # the workload's prompt-length class
    send: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (the final usage)
    phases: dict[str, float] = field(default_factory=dict)  # the final usage's, milliseconds
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


class _Release:
    """Holds a run's last item back until every other item has streamed ``after_tokens``
    tokens (or ended); with ``after_tokens`` None nothing is held."""

    def __init__(self, num_items: int, after_tokens: int | None) -> None:
        self.after_tokens = after_tokens or 0
        self.waiting = set(range(num_items - 1)) if after_tokens is not None else set()
        self.event = asyncio.Event()
        if not self.waiting:
            self.event.set()

    def progressed(self, index: int, rec: RequestRecord, ended: bool = False) -> None:
        if index in self.waiting and (ended or rec.output_tokens >= self.after_tokens):
            self.waiting.discard(index)
            if not self.waiting:
                self.event.set()


async def _stream(
    stub: Any, item: WorkItem, rec: RequestRecord, progressed: Any, timeout_s: float
) -> None:
    """Send ``item`` and record its chunks' times and tokens, and the final usage, into
    ``rec``; ``progressed(rec)`` after each chunk. A gRPC error ends it in ``rec.error``."""
    import grpc

    from cluster.pb.pdserve.v1 import generation_pb2 as pb

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
                rec.chunk_tokens.append(len(msg.token_ids))
                rec.output_tokens += len(msg.token_ids)
                progressed(rec)
            if msg.HasField("usage"):
                rec.cached_tokens = msg.usage.cached_tokens
                ph = msg.usage.phases
                rec.phases = {name: getattr(ph, name) for name in PHASES}
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"


async def run_load(
    target: str,
    items: Sequence[WorkItem],
    offsets: Sequence[float],
    timeout_s: float = 600.0,
    last_after_tokens: int | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send each item at its offset over gRPC to ``target`` (one arm's router); returns the
    records and the run's duration. ``last_after_tokens``: the last item is held until every
    other one has streamed that many tokens (or ended), and its offset counts from then."""
    import grpc

    from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

    release = _Release(len(items), last_after_tokens)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(index: int, item: WorkItem, offset: float) -> RequestRecord:
            rec = RequestRecord(len(item.token_ids), item.max_tokens, item.cls)
            base = start
            if index == len(items) - 1 and not release.event.is_set():
                await release.event.wait()
                base = time.perf_counter()
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
            try:
                await _stream(stub, item, rec, lambda r: release.progressed(index, r), timeout_s)
            finally:
                release.progressed(index, rec, ended=True)
            return rec

        records = await asyncio.gather(
            *(one(n, i, o) for n, (i, o) in enumerate(zip(items, offsets, strict=True)))
        )
        return list(records), time.perf_counter() - start


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    slos: SLOs | None = None,
) -> dict[str, Any]:
    """The run's metrics; goodput against ``slos`` (per class) or one (TTFT, TPOT) bound."""
    if slos is None and ttft_slo_s is not None and tpot_slo_s is not None:
        slos = SLOs({c: (ttft_slo_s, tpot_slo_s) for c in {r.cls for r in records}})
    out = slo_metrics(records, duration_s, slos)
    ok = [r for r in records if r.ok]
    out["output_throughput"] = (
        sum(min(r.output_tokens, r.max_tokens) for r in ok) / duration_s if duration_s > 0 else 0.0
    )
    out["itl_s"] = summary([g for r in ok for g in r.itls])
    return out
