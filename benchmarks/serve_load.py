"""Load generation and client-side metrics for P1 (as vLLM's and SGLang's serving benchmarks).

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
import contextlib
import itertools
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.common.protocol import PHASES
from cluster.planner.metrics import slo_metrics, summary
from cluster.planner.workload import MIXED_LONG, SLOs, WorkItem, poisson_offsets

__all__ = [
    "RequestRecord",
    "WorkItem",
    "arm_ports",
    "compute_metrics",
    "local_apps",
    "poisson_offsets",
]


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


def mixed_long(num: int, vocab_size: int, seed: int, scale: float = 1.0) -> list[WorkItem]:
    """BENCHMARKS.md ``mixed-long``: 80% chat (64-128 in / 64 out), 20% long (768-1024 / 32).

    ``scale`` shrinks every length (smoke runs on tiny models)."""
    return MIXED_LONG.items(num, vocab_size, seed, scale)


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

    from cluster.pb.pdserve.v1 import generation_pb2 as pb
    from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

    waiting = set(range(len(items) - 1)) if last_after_tokens is not None else set()
    released = asyncio.Event()
    if not waiting:
        released.set()

    def progressed(index: int, rec: RequestRecord, ended: bool = False) -> None:
        if index in waiting and (ended or rec.output_tokens >= (last_after_tokens or 0)):
            waiting.discard(index)
            if not waiting:
                released.set()

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(index: int, item: WorkItem, offset: float) -> RequestRecord:
            rec = RequestRecord(len(item.token_ids), item.max_tokens, item.cls)
            base = start
            if index == len(items) - 1 and not released.is_set():
                await released.wait()
                base = time.perf_counter()
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
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
                        progressed(index, rec)
                    if msg.HasField("usage"):
                        rec.cached_tokens = msg.usage.cached_tokens
                        ph = msg.usage.phases
                        rec.phases = {name: getattr(ph, name) for name in PHASES}
            except grpc.aio.AioRpcError as e:
                rec.error = f"{e.code().name}: {e.details()}"
            finally:
                progressed(index, rec, ended=True)
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


def arm_ports(configs: dict[str, Any]) -> dict[str, Any]:
    """Each arm its own gRPC port (the first arm's, then the next ones up): every Router
    replica serves gRPC itself on ``router.grpc_port``, so arms side by side cannot share one.
    A port above the first that something already listens on or holds (another process's
    connection: the first port may come from the ephemeral range) is skipped for a free one."""
    base = next(iter(configs.values())).router.grpc_port
    out: dict[str, Any] = {}
    port = base
    for i, (arm, cfg) in enumerate(configs.items()):
        if i:
            port += 1
            while not _port_free(cfg.router.host, port):
                port += 1
        out[arm] = cfg.replace({"router.grpc_port": port})
    return out


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _local_serve() -> Iterator[Callable[[Any, bool], bool]]:
    """One local Ray/Serve instance for a benchmark: ``start_once(cfg, deploy_app)`` starts it
    on the first call (the router ports of ``cfg``) and says whether it did; leaving the block
    shuts everything down."""
    from cluster.serve_main import start

    started = False

    def start_once(cfg: Any, deploy_app: bool) -> bool:
        nonlocal started
        if started:
            return False
        # The arms share the node (side by side, or redeployed one after another while the
        # old replicas still run): none owns cores, or the first deployed would (cpu_binding).
        start(cfg, metrics_port=None, deploy_app=deploy_app, bind_cpus=False)
        started = True
        return True

    try:
        yield start_once
    finally:
        if started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()


@contextlib.contextmanager
def local_apps() -> Iterator[Callable[[str, Any], None]]:
    """Benchmark arms as Serve applications side by side: ``put(name, cfg)`` deploys (or
    redeploys) arm ``name`` beside the others (each on its own gRPC port: ``arm_ports``)."""
    from ray import serve

    from cluster.app import build_application
    from cluster.serve_main import local_threads

    with _local_serve() as start_once:

        def put(name: str, cfg: Any) -> None:
            start_once(cfg, False)
            app = build_application(local_threads(cfg, bind=False))  # see _local_serve
            serve.run(app, name=name, route_prefix=f"/{name}")

        yield put


@contextlib.contextmanager
def local_cluster() -> Iterator[Callable[[Any], None]]:
    """Benchmark arms one after another: ``put(cfg)`` starts the cluster with the first arm and
    redeploys the app with each later one."""
    from cluster.serve_main import deploy

    with _local_serve() as start_once:

        def put(cfg: Any) -> None:
            if not start_once(cfg, True):
                deploy(cfg)

        yield put
