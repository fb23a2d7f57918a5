"""``pdserve profile``: measure this machine's step-cost profile for ``pdserve plan``.

What it measures (the file format is ``cluster.planner.profile``):
  1. Engine steps, per torch-thread count (CPU; on a GPU the one device), on the real engine
     (``LLMEngine.step``, the model, sampling and bookkeeping included):
       * one prefill chunk of N tokens at context 0 (a fresh prompt, chunking off);
       * a 256-token chunk after 512 / 1024 / 1536 cached tokens (prefix-cache hits supply the
         context, so only the timed chunk is computed): the per (token x context) term;
       * decode steps of B sequences at context C, the prompt KV filled synthetically (as
         ``bench decode-scaling``), on a B x C grid;
       * a few mixed steps (decodes + a prefill chunk), predicted and measured: the model's
         self-check, kept in ``measured.self_check``.
     Each point is the median of a few repetitions, sizes alternating up and down.
  2. KV pulls of 4 and 64 blocks over each transport (shm, zmq ipc) between a sender and a
     receiver in this process: ``fixed_s + bytes / bytes_per_s`` by least squares.
  3. Serving (unless ``--no-serving``; skipped in ``--smoke``): a colocated and a 1P1D arm on
     a local Ray Serve cluster (``bench serve``'s arms), a few unloaded requests of each
     ``mixed-long`` class: what the stack adds around the engine (TTFT minus the engine's
     prefill, the engine's prefill inside a replica and the client's TPOT over the bare
     engine's). These are unloaded single requests, plus a burst of ``BURST`` short ones sent
     at once and a long prompt while they decode: what each decode step gains per concurrent
     stream, and how much a pool's steps slow while the other pool computes (``burst_costs``).
     ``pdserve plan --validate`` checks the predictions under load.
"""

from __future__ import annotations

import dataclasses
import itertools
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_scaling import _start_batch
from benchmarks.workloads import FIRST_PLAIN_TOKEN, bench_model_dir, exact_tokens
from cluster.config import ClusterConfig, cpu_count
from cluster.engine.engine import LLMEngine
from cluster.planner.profile import Profile, ServingCost, StepCosts, TransferCost

Progress = Callable[[str], None]
BURST = 8  # concurrent requests of the serving calibration's burst (a loaded run's concurrency)


def _grid(mode: str) -> dict[str, Any]:
    full = mode == "full"
    quick = mode == "quick"
    if mode == "smoke":
        return {
            "prefill": (1, 16, 64),
            "offsets": (0, 64),
            "chunk": 32,
            "batch": (1, 4),
            "context": (32, 64),
            "reps": 1,
            "steps": 2,
        }
    return {
        "prefill": (1, 16, 64, 128, 256, 512, 1024, 2048) if full else (1, 16, 64, 256, 1024, 2048),
        "offsets": (0, 512, 1024, 1536) if full else (0, 1024),
        "chunk": 256,
        "batch": (1, 2, 4, 8, 16, 32) if full else (1, 4, 16, 32),
        "context": (128, 512, 1024) if full or quick else (128, 1024),
        "reps": 3 if full else 2,
        "steps": 4 if full else 3,
    }


def _engine(config: ClusterConfig, threads: int, grid: dict[str, Any]) -> LLMEngine:
    block = config.cache.block_size
    longest = max(max(grid["prefill"]), max(grid["offsets"]) + grid["chunk"])
    per_seq = -(-(max(grid["context"]) + grid["steps"] + 8) // block)
    blocks = max(max(grid["batch"]) * per_seq, 2 * -(-longest // block)) + 32
    cfg = config.replace(
        {
            "model.num_threads": threads,
            "cache.num_blocks": blocks,
            "scheduler.chunk_size": None,
            "scheduler.max_num_batched_tokens": max(longest, 2048) + 64,
            "scheduler.max_num_seqs": max(max(grid["batch"]), 8) + 1,
            "model.max_model_len": max(longest, max(grid["context"])) + 64,
        }
    )
    return LLMEngine(cfg, role="decode")


def _timed_step(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]


def _finish(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def measure_steps(engine: LLMEngine, grid: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Raw step times (seconds, medians) of one engine: prefill, context, decode, mixed."""
    rng = random.Random(11)
    vocab = engine.vocab_size
    n = iter(range(1 << 30))
    # Warm-up: first-call allocations, the native kernels' first compile.
    engine.add("warm", _prompt(rng, 64, vocab), exact_tokens(3))
    _finish_run(engine)
    reps = grid["reps"]

    def prefill_once(tokens: int) -> float:
        engine.add(f"p{next(n)}", _prompt(rng, tokens, vocab), exact_tokens(1))
        t = _timed_step(engine)
        _finish(engine)
        return t

    prefill: dict[int, list[float]] = {t: [] for t in grid["prefill"]}
    for rep in range(reps):
        sizes = grid["prefill"] if rep % 2 == 0 else grid["prefill"][::-1]
        for tokens in sizes:
            prefill[tokens].append(prefill_once(tokens))
    progress(
        "prefill: "
        + ", ".join(f"{t}: {statistics.median(v) * 1e3:.0f} ms" for t, v in prefill.items())
    )

    chunk = grid["chunk"]
    context: dict[int, list[float]] = {o: [] for o in grid["offsets"]}
    for _ in range(reps):
        for off in grid["offsets"]:
            prefix = _prompt(rng, off, vocab)
            if off:
                engine.add(f"c{next(n)}", prefix, exact_tokens(1))  # cached for the next one
                _finish_run(engine)
            engine.add(f"c{next(n)}", prefix + _prompt(rng, chunk, vocab), exact_tokens(1))
            context[off].append(_timed_step(engine))
            _finish(engine)
    progress(
        f"chunk {chunk} after context: "
        + ", ".join(f"{o}: {statistics.median(v) * 1e3:.0f} ms" for o, v in context.items())
    )

    decode: dict[tuple[int, int], list[float]] = {}
    cells = [(b, c) for b in grid["batch"] for c in grid["context"]]
    for rep in range(reps):
        for b, c in cells if rep % 2 == 0 else cells[::-1]:
            rids = _start_batch(engine, rng, f"d{next(n)}", b, c, grid["steps"] + 4)
            engine.step()  # admits the batch
            times = [_timed_step(engine) for _ in range(grid["steps"])]
            decode.setdefault((b, c), []).append(statistics.median(times))
            for rid in rids:
                engine.abort_request(rid)
            _finish(engine)
    progress(
        "decode: "
        + ", ".join(
            f"b{b}/c{c}: {statistics.median(v) * 1e3:.0f} ms" for (b, c), v in decode.items()
        )
    )

    mixed = []
    for b, c, tokens in (
        (4, max(grid["context"][0], 64), grid["prefill"][2]),
        (max(grid["batch"]) // 2 or 1, grid["context"][-1], chunk),
    ):
        times = []
        for _ in range(reps):
            rids = _start_batch(engine, rng, f"m{next(n)}", b, c, 8)
            engine.step()
            engine.add(f"m{next(n)}", _prompt(rng, tokens, vocab), exact_tokens(1))
            times.append(_timed_step(engine))
            for rid in rids:
                engine.abort_request(rid)
            _finish(engine)
        mixed.append(
            {
                "decode_batch": b,
                "decode_context": c,
                "prefill_tokens": tokens,
                "measured_s": statistics.median(times),
            }
        )
    engine.check_integrity()
    return {
        "prefill": {str(t): statistics.median(v) for t, v in prefill.items()},
        "context": {str(o): statistics.median(v) for o, v in context.items()},
        "decode": {f"{b},{c}": statistics.median(v) for (b, c), v in decode.items()},
        "chunk": chunk,
        "mixed": mixed,
    }


def _finish_run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def step_costs(raw: dict[str, Any], grid: dict[str, Any]) -> StepCosts:
    """The measured points as a cost table (the context term by least squares)."""
    chunk = raw["chunk"]
    offs = [int(o) for o in raw["context"]]
    base = raw["context"]["0"]
    pairs = [(o, raw["context"][str(o)] - base) for o in offs if o]
    # extra seconds = a * chunk * offset  ->  a = sum(x y) / sum(x x), x = chunk * offset
    num = sum(chunk * o * dt for o, dt in pairs)
    den = sum((chunk * o) ** 2 for o, _ in pairs)
    a = max(0.0, num / den) if den else 0.0
    batches, contexts = list(grid["batch"]), list(grid["context"])
    return StepCosts(
        tuple(float(t) for t in grid["prefill"]),
        tuple(raw["prefill"][str(t)] for t in grid["prefill"]),
        a,
        tuple(float(b) for b in batches),
        tuple(float(c) for c in contexts),
        tuple(tuple(raw["decode"][f"{b},{c}"] for c in contexts) for b in batches),
    )


def measure_transfer(
    config: ClusterConfig, layout: Any, progress: Progress, reps: int
) -> dict[str, TransferCost]:
    """Pulls of 4 and 64 blocks per transport, sender and receiver in this process."""
    import dataclasses

    from cluster.kv_transfer import KVPool, KVReceiver, KVSender

    sizes = (4, 64)
    out: dict[str, TransferCost] = {}
    cfg = dataclasses.replace(config.transfer, lease_s=30.0, heartbeat_s=5.0)
    src = KVPool.allocate(layout, max(sizes), shared=True)
    dst = KVPool.allocate(layout, max(sizes))
    assert src.bytes is not None
    src.bytes[:] = 7  # touched: no page faults while timed
    sender = KVSender(cfg, src, on_release=lambda rid, why: None)
    sender.start()
    try:
        for name, transports, ipc in (("shm", ("shm",), True), ("zmq", ("zmq",), True)):
            receiver = KVReceiver(dataclasses.replace(cfg, transports=transports, ipc=ipc), dst)
            receiver.start()
            try:
                times: dict[int, list[float]] = {n: [] for n in sizes}
                for rep in range(reps + 1):
                    for n in sizes:
                        ids = list(range(n))
                        params = sender.register(
                            f"{name}-{rep}-{n}", ids, num_tokens=n * layout.block_size
                        )
                        t0 = time.perf_counter()
                        receiver.pull(params, ids)
                        if rep:  # the first round is a warm-up
                            times[n].append(time.perf_counter() - t0)
            finally:
                receiver.close()
            med = {n: statistics.median(v) for n, v in times.items()}
            (n0, n1), bpb = sizes, layout.bytes_per_block
            slope = max(1e-12, (med[n1] - med[n0]) / ((n1 - n0) * bpb))
            fixed = max(0.0, med[n0] - slope * n0 * bpb)
            out[name] = TransferCost(fixed, 1.0 / slope)
            progress(f"transfer {name}: {fixed * 1e3:.2f} ms + {1e-9 / slope:.2f} GB/s")
    finally:
        sender.close()
    return out


def measure_serving(
    config: ClusterConfig,
    mode: str,
    steps: dict[str, StepCosts],
    transfer: dict[str, TransferCost],
    bytes_per_block: int,
    progress: Progress,
) -> tuple[dict[str, ServingCost], dict[str, Any]]:
    """Unloaded requests on a local Ray Serve cluster, a colocated and a 1P1D arm."""
    from benchmarks.serve import arm_config, measure
    from benchmarks.serve_load import local_apps
    from cluster.config.model_paths import model_limits
    from cluster.planner.workload import MIXED_LONG

    model = str(config.model.path)
    configs = {
        "local": arm_config(config, "colocated", 1400, model),
        "remote": arm_config(config, "disagg", 1400, model),
    }
    vocab = model_limits(configs["local"]).vocab_size
    with local_apps() as put:
        runs = measure(
            put,
            configs,
            MIXED_LONG,
            rates=[],
            per_rate=0,
            per_class=2 if mode == "quick" else 4,
            vocab=vocab,
            scale=1.0,
            progress=progress,
            burst=BURST,
        )
    serving: dict[str, ServingCost] = {}
    raw: dict[str, Any] = {}
    for kind, cfg in configs.items():
        serving[kind], raw[kind] = calibrate(
            kind,
            serving_samples(runs.unloaded[kind]),
            steps,
            cfg,
            transfer.get(cfg.transfer.transports[0]),
            bytes_per_block,
            [burst_samples(runs.burst[kind])] if kind in runs.burst else [],
        )
        progress(f"serving {kind}: {serving[kind]}")
    return serving, raw


@dataclasses.dataclass
class ServingSample:
    """One unloaded request as the client saw it: token times from its send, and the prefill
    compute the engine that ran it reported."""

    prompt_len: int
    max_tokens: int
    token_times: list[float]
    prefill_s: float


@dataclasses.dataclass
class BurstSample:
    """One request of a burst: its chunks' arrival times (this process's clock, shared by the
    burst), how many tokens each carried, and the prefill compute its engine reported."""

    prompt_len: int
    max_tokens: int
    chunk_times: list[float]
    chunk_tokens: list[int]
    prefill_s: float = 0.0


def burst_samples(records: Sequence[Any]) -> list[BurstSample]:
    """A burst's ``RequestRecord``s (``bench serve``'s ``measure``: the short ones, then the long
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


def serving_samples(records: Sequence[Any]) -> list[ServingSample]:
    """``bench serve``'s unloaded ``RequestRecord``s that completed, as calibration samples."""
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
    prefill_scale, decode_scale, ttft_over, handoff = [], [], [], []
    for s in samples:
        ttft = s.token_times[0]
        prefill_scale.append(s.prefill_s / predicted_prefill(pc, s.prompt_len, chunk))
        ttft_over.append(max(0.0, ttft - s.prefill_s))
        # Steady decode: from the second token on (the first gap holds the remote hand-off).
        rest = s.token_times[1:]
        if len(rest) >= 2:
            per_token = (rest[-1] - rest[0]) / (len(rest) - 1)
            decode_scale.append(per_token / dc.decode(1, s.prompt_len + s.max_tokens / 2))
    d_scale = statistics.median(decode_scale) if decode_scale else 1.0
    if not local:
        for s in samples:
            if len(s.token_times) < 2:
                continue
            blocks = -(-s.prompt_len // cfg.cache.block_size)
            pull = transfer.seconds(blocks * bytes_per_block) if transfer is not None else 0.0
            step = dc.decode(1, s.prompt_len + 1) * d_scale
            handoff.append(max(0.0, s.token_times[1] - s.token_times[0] - pull - step))
    if not prefill_scale:
        raise RuntimeError(f"profile: no unloaded {kind} request completed")
    p_scale = statistics.median(prefill_scale)
    streams, decode_cont, prefill_cont, bursts_raw = [], [], [], []
    for burst in bursts:
        shorts, long = (burst[:-1], burst[-1]) if len(burst) > 1 else (burst, None)
        stream_s, contention, burst_raw = burst_costs(shorts, long, dc, d_scale)
        bursts_raw.append(burst_raw)
        if "engine_step_s" in burst_raw:  # the shorts decoded together: a fit
            streams.append(stream_s)
            if burst_raw["per_token_during_prefill_s"]:
                decode_cont.append(contention)
        if not local and long is not None and long.prefill_s > 0:
            # The long prompt prefilled while the shorts decoded on the other replica.
            alone = predicted_prefill(pc, long.prompt_len, chunk) * p_scale
            prefill_cont.append(max(0.0, long.prefill_s / alone - 1))
            burst_raw["long_prefill_s"], burst_raw["long_prefill_alone_s"] = long.prefill_s, alone
    cost = ServingCost(
        ttft_overhead_s=statistics.median(ttft_over),
        prefill_scale=p_scale,
        decode_scale=d_scale,
        handoff_s=statistics.median(handoff) if handoff else 0.0,
        stream_s=statistics.median(streams) if streams else 0.0,
        decode_contention=statistics.median(decode_cont) if decode_cont and not local else 0.0,
        prefill_contention=statistics.median(prefill_cont) if prefill_cont else 0.0,
    )
    raw = {
        "bursts": bursts_raw,
        "prefill_scale": prefill_scale,
        "decode_scale": decode_scale,
        "ttft_overhead_s": ttft_over,
        "handoff_s": handoff,
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
    out = []
    for m in mixed:
        pred = costs.step([(m["prefill_tokens"], 0)], [m["decode_context"] + 1] * m["decode_batch"])
        out.append({**m, "predicted_s": pred, "error": pred / m["measured_s"] - 1})
    return out


def run_profile(
    config: ClusterConfig,
    mode: str,
    out: Path,
    threads: Sequence[int] | None = None,
    serving: bool = True,
    progress: Progress = lambda msg: print(msg, flush=True),
) -> Profile:
    grid = _grid(mode)
    from benchmarks.harness import BenchContext

    ctx = BenchContext(name="profile", mode=mode, config=config)
    model_dir = bench_model_dir(ctx)
    config = config.replace({"model.path": str(model_dir)})
    cuda = torch.cuda.is_available() and config.model.device != "cpu"
    if threads is None:
        threads = (1,) if cuda else tuple(sorted({1, min(2, cpu_count())}))
    steps: dict[str, StepCosts] = {}
    measured: dict[str, Any] = {
        "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in grid.items()}
    }
    layout = None
    for n in threads:
        progress(f"engine steps, {n} torch thread(s)")
        torch.set_num_threads(n)
        engine = _engine(config, n, grid)
        layout = engine.runner.layout
        raw = measure_steps(engine, grid, progress)
        costs = step_costs(raw, grid)
        key = "device" if cuda else str(n)
        steps[key] = costs
        measured[f"steps_{key}"] = raw
        measured[f"self_check_{key}"] = self_check(costs, raw["mixed"])
        del engine
    assert layout is not None
    transfer = measure_transfer(config, layout, progress, reps=grid["reps"] + 1)
    serving_costs: dict[str, ServingCost] = {}
    if serving and mode != "smoke" and not cuda:
        serving_costs, measured["serving"] = measure_serving(
            config, mode, steps, transfer, layout.bytes_per_block, progress
        )
    device = {
        "kind": "cuda" if cuda else "cpu",
        "name": torch.cuda.get_device_name(0)
        if cuda
        else platform.processor() or platform.machine(),
        "cores": cpu_count(),
        "platform": platform.platform(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": mode,
    }
    profile = Profile(
        device=device,
        model={
            "name": layout.model,
            "dtype": layout.dtype,
            "block_size": layout.block_size,
            "bytes_per_block": layout.bytes_per_block,
        },
        steps=steps,
        transfer=transfer,
        serving=serving_costs,
        measured=measured,
    )
    profile.save(out)
    progress(f"wrote {out}")
    return profile
