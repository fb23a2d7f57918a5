"""The serving section of a profile, calibrated from requests a local cluster served (torch-free).

``pdserve profile`` (``cluster.planner.measure.profiler``) and ``pdserve plan --validate``
(``cluster.planner.measure.validate``) send unloaded requests and bursts to deployed arms; this
module turns what the client saw into ``ServingCost``: what the stack adds around the bare
engine's step costs (``calibrate``). It also predicts a lone prompt's prefill from a step-cost
table (``predicted_prefill``), and checks a table against measured mixed steps (``self_check``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig
from cluster.planner.profile import ServingCost, StepCosts, TransferCost

BURST = 8  # concurrent requests of the serving calibration's burst (a loaded run's concurrency)


@dataclass(slots=True)
class ServingSample:
    """One unloaded request as the client saw it: token times from its send, and the prefill
    compute the engine that ran it reported."""

    prompt_len: int
    max_tokens: int
    token_times: list[float]
    prefill_s: float


@dataclass(slots=True)
class BurstSample:
    """One request of a burst: its chunks' arrival times (this process's clock, shared by the
    burst), how many tokens each carried, and the prefill compute its engine reported."""

    prompt_len: int
    max_tokens: int
    chunk_times: list[float]
    chunk_tokens: list[int]
    prefill_s: float = 0.0


def burst_samples(records: Sequence[Any]) -> list[BurstSample]:
    """A burst's ``RequestRecord``s (``measure.arms.measure``: the short ones, then the long
    prompt last) as calibration samples; a failed one stays, with no chunks."""
    return [
        BurstSample(
            r.prompt_len,
            r.max_tokens,
            list(r.chunk_times) if r.ok else [],
            list(r.chunk_tokens) if r.ok else [],
            r.phases.get("prefill_ms", 0.0) / 1000 if r.ok else 0.0,
        )
        for r in records
    ]


def serving_samples(records: Sequence[Any]) -> list[ServingSample]:
    """Unloaded ``RequestRecord``s that completed, as calibration samples."""
    return [
        ServingSample(
            r.prompt_len,
            r.max_tokens,
            [t - r.send for t in r.chunk_times],
            r.phases["prefill_ms"] / 1000,
        )
        for r in records
        if r.ok and r.phases
    ]


def _gaps(samples: Sequence[BurstSample], start: float, end: float) -> list[tuple[float, float]]:
    """(midpoint, seconds per token) of every gap between two chunks of a request, both within
    [start, end]."""
    out = []
    for s in samples:
        inside = [
            (t, n) for t, n in zip(s.chunk_times, s.chunk_tokens, strict=True) if start <= t <= end
        ]
        for (a, _), (b, n) in itertools.pairwise(inside):
            if n:
                out.append(((a + b) / 2, (b - a) / n))
    return out


def burst_costs(
    shorts: Sequence[BurstSample],
    long: BurstSample | None,
    dc: StepCosts,
    decode_scale: float,
) -> tuple[float, float, dict[str, Any]]:
    """From a burst of k short requests and a long prompt sent while they decode:
    ``(stream_s, decode_contention, raw)``.

    * ``stream_s``: the time per token while all k decode together (from the last one's second
      token, its first decode step, to the first one's last), outside the long prompt's
      prefill, less the engine's decode step at batch k (the profile's, times the unloaded
      ``decode_scale``, which already holds one stream's share), over the k - 1 other streams;
    * ``decode_contention``: the time per token while the long prompt prefills (on another
      replica: a remote arm), over the time per token outside it, less 1."""
    done = [s for s in shorts if len(s.chunk_times) >= 3]
    k = len(done)
    raw: dict[str, Any] = {"requests": len(shorts), "streams": k}
    if k < 2:
        return 0.0, 0.0, raw
    start = max(s.chunk_times[1] for s in done)
    end = min(s.chunk_times[-1] for s in done)
    if long is not None and long.chunk_times and long.prefill_s > 0:
        busy = (long.chunk_times[0] - long.prefill_s, long.chunk_times[0])  # its prefill
    else:
        busy = (float("inf"), float("inf"))
    gaps = _gaps(done, start, end)
    alone = [g for t, g in gaps if not busy[0] <= t <= busy[1]]
    during = [g for t, g in gaps if busy[0] <= t <= busy[1]]
    raw["per_token_alone_s"], raw["per_token_during_prefill_s"] = alone, during
    if not alone:  # the streams never all decoded at once
        return 0.0, 0.0, raw
    step = statistics.median(alone)
    context = statistics.mean(s.prompt_len + s.max_tokens / 2 for s in done)
    engine = dc.decode(k, context) * decode_scale
    raw["engine_step_s"] = engine
    stream_s = max(0.0, (step - engine) / (k - 1))
    contention = max(0.0, statistics.median(during) / step - 1) if during else 0.0
    return stream_s, contention, raw


@dataclass(slots=True)
class _Unloaded:
    """Per unloaded sample: the engine's prefill over the bare engine's, the client's TPOT over
    the bare decode step, the TTFT beyond the prefill, and (remote) the hand-off's excess."""

    prefill_scale: list[float] = field(default_factory=list)
    decode_scale: list[float] = field(default_factory=list)
    ttft_overhead_s: list[float] = field(default_factory=list)
    handoff_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Bursts:
    """Per burst: the stream cost and each pool's contention, and the raw figures behind them."""

    stream_s: list[float] = field(default_factory=list)
    decode_contention: list[float] = field(default_factory=list)
    prefill_contention: list[float] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)


def _unloaded(
    samples: Sequence[ServingSample], pc: StepCosts, chunk: int | None, dc: StepCosts
) -> _Unloaded:
    out = _Unloaded()
    for s in samples:
        ttft = s.token_times[0]
        out.prefill_scale.append(s.prefill_s / predicted_prefill(pc, s.prompt_len, chunk))
        out.ttft_overhead_s.append(max(0.0, ttft - s.prefill_s))
        # Steady decode: from the second token on (the first gap holds the remote hand-off).
        rest = s.token_times[1:]
        if len(rest) >= 2:
            per_token = (rest[-1] - rest[0]) / (len(rest) - 1)
            out.decode_scale.append(per_token / dc.decode(1, s.prompt_len + s.max_tokens / 2))
    return out


def _handoffs(
    samples: Sequence[ServingSample],
    cfg: ClusterConfig,
    transfer: TransferCost | None,
    bytes_per_block: int,
    dc: StepCosts,
    decode_scale: float,
) -> list[float]:
    """A remote arm's first gap beyond the KV pull and one decode step: the hand-off's hops."""
    out = []
    for s in samples:
        if len(s.token_times) < 2:
            continue
        blocks = -(-s.prompt_len // cfg.cache.block_size)
        pull = transfer.seconds(blocks * bytes_per_block) if transfer is not None else 0.0
        step = dc.decode(1, s.prompt_len + 1) * decode_scale
        out.append(max(0.0, s.token_times[1] - s.token_times[0] - pull - step))
    return out


def _bursts(
    bursts: Sequence[Sequence[BurstSample]],
    local: bool,
    dc: StepCosts,
    decode_scale: float,
    lone_prefill: tuple[StepCosts, int | None, float],
) -> _Bursts:
    """Every burst's figures (``burst_costs``); ``lone_prefill``: the prefill table, chunk size
    and unloaded prefill scale a remote arm's long prompt would prefill at alone."""
    pc, chunk, prefill_scale = lone_prefill
    out = _Bursts()
    for burst in bursts:
        shorts, long = (burst[:-1], burst[-1]) if len(burst) > 1 else (burst, None)
        stream_s, contention, burst_raw = burst_costs(shorts, long, dc, decode_scale)
        out.raw.append(burst_raw)
        if "engine_step_s" in burst_raw:  # the shorts decoded together: a fit
            out.stream_s.append(stream_s)
            if burst_raw["per_token_during_prefill_s"]:
                out.decode_contention.append(contention)
        if not local and long is not None and long.prefill_s > 0:
            # The long prompt prefilled while the shorts decoded on the other replica.
            alone = predicted_prefill(pc, long.prompt_len, chunk) * prefill_scale
            out.prefill_contention.append(max(0.0, long.prefill_s / alone - 1))
            burst_raw["long_prefill_s"], burst_raw["long_prefill_alone_s"] = long.prefill_s, alone
    return out


def _median_or_zero(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def calibrate(
    kind: str,
    samples: Sequence[ServingSample],
    steps: dict[str, StepCosts],
    cfg: ClusterConfig,
    transfer: TransferCost | None,
    bytes_per_block: int,
    bursts: Sequence[Sequence[BurstSample]] = (),
) -> tuple[ServingCost, dict[str, Any]]:
    """What the serving stack adds around the engine, from unloaded requests (``kind`` local:
    a colocated replica; remote: prefill and decode apart): the hops before the first token,
    the engine's prefill and decode steps inside a replica over the bare engine's, (remote)
    the hand-off between the KV landing and the decode batch's first step, and, given
    ``bursts`` of concurrent requests (each: short ones, then a long prompt), the step's cost
    per streamed token and (remote) each pool's slowdown while the other computes
    (``burst_costs``). Every figure is a median: over the samples, and over the bursts (one
    burst is one moment of a shared machine)."""
    local = kind == "local"
    pc, chunk = prefill_costs(kind, steps, cfg)
    first = next(iter(steps.values()))  # a GPU profile has one table
    dc = steps.get(str(cfg.decode.num_threads or 1), first)
    unloaded = _unloaded(samples, pc, chunk, dc)
    d_scale = statistics.median(unloaded.decode_scale) if unloaded.decode_scale else 1.0
    if not local:
        unloaded.handoff_s = _handoffs(samples, cfg, transfer, bytes_per_block, dc, d_scale)
    if not unloaded.prefill_scale:
        raise RuntimeError(f"profile: no unloaded {kind} request completed")
    p_scale = statistics.median(unloaded.prefill_scale)
    b = _bursts(bursts, local, dc, d_scale, (pc, chunk, p_scale))
    cost = ServingCost(
        ttft_overhead_s=statistics.median(unloaded.ttft_overhead_s),
        prefill_scale=p_scale,
        decode_scale=d_scale,
        handoff_s=_median_or_zero(unloaded.handoff_s),
        stream_s=_median_or_zero(b.stream_s),
        decode_contention=0.0 if local else _median_or_zero(b.decode_contention),
        prefill_contention=_median_or_zero(b.prefill_contention),
    )
    raw = {
        "bursts": b.raw,
        "prefill_scale": unloaded.prefill_scale,
        "decode_scale": unloaded.decode_scale,
        "ttft_overhead_s": unloaded.ttft_overhead_s,
        "handoff_s": unloaded.handoff_s,
    }
    return cost, raw


def prefill_costs(
    kind: str, steps: dict[str, StepCosts], cfg: ClusterConfig
) -> tuple[StepCosts, int | None]:
    """The bare engine's step costs a ``kind`` arm prefills with (local: its decode replica's
    threads; remote: its prefill replica's), and that pool's chunk size."""
    local = kind == "local"
    threads = cfg.decode.num_threads if local else cfg.prefill.num_threads
    first = next(iter(steps.values()))  # a GPU profile has one table
    chunk = cfg.for_pool("decode" if local else "prefill").scheduler.chunk_size
    return steps.get(str(threads or 1), first), chunk


def predicted_prefill(costs: StepCosts, tokens: int, chunk: int | None) -> float:
    """A lone prompt's prefill time: its chunks one step each."""
    if chunk is None:
        return costs.step([(tokens, 0)], [])
    return sum(costs.step([(min(chunk, tokens - off), off)], []) for off in range(0, tokens, chunk))


def self_check(costs: StepCosts, mixed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's prediction of each measured mixed step (decodes and a prefill chunk)."""
    out = []
    for m in mixed:
        pred = costs.step([(m["prefill_tokens"], 0)], [m["decode_context"] + 1] * m["decode_batch"])
        out.append({**m, "predicted_s": pred, "error": pred / m["measured_s"] - 1})
    return out
