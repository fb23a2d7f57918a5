"""The bare engine's step costs and the KV pulls' costs on this machine (``pdserve profile``).

Engine steps, per torch-thread count (CPU; on a GPU the one device), on the real engine
(``LLMEngine.step``, the model, sampling and bookkeeping included):
  * one prefill chunk of N tokens at context 0 (a fresh prompt, chunking off);
  * a chunk after some cached tokens (prefix-cache hits supply the context, so only the timed
    chunk is computed): the per (token x context) term;
  * decode steps of B sequences at context C, the prompt KV filled synthetically
    (``start_batch``, as ``bench decode-scaling`` does), on a B x C grid;
  * a few mixed steps (decodes + a prefill chunk), predicted and measured: the model's
    self-check.
Each point is the median of a few repetitions, sizes alternating up and down. KV pulls of 4 and
64 blocks over each transport (shm, zmq ipc) between a sender and a receiver in this process:
``fixed_s + bytes / bytes_per_s`` by least squares.
"""

from __future__ import annotations

import atexit
import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from cluster.common.kv_layout import KVLayout
from cluster.common.protocol import FirstToken
from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig
from cluster.config.model_paths import require_model_dir
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.planner.profile import StepCosts, TransferCost
from cluster.planner.workload import FIRST_PLAIN_TOKEN

Progress = Callable[[str], None]
_tiny_model_dir: Path | None = None


def tiny_model_dir() -> Path:
    """Build the tiny random Llama once per process into a temp dir (removed at exit)."""
    global _tiny_model_dir
    if _tiny_model_dir is None:
        from cluster.engine.models.tiny import build_tiny_llama

        tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-tiny-"))
        atexit.register(shutil.rmtree, tmp, True)
        _tiny_model_dir = build_tiny_llama(tmp / "model")
    return _tiny_model_dir


def model_dir(config: ClusterConfig, mode: str) -> Path:
    """The checkpoint a measurement loads: the config's model; in smoke mode, unless the
    config names one, the tiny random model."""
    if config.model.path is None:
        if mode == "smoke":
            return tiny_model_dir()
        from cluster.engine.models.default_model import ensure_default_model

        return ensure_default_model(config)
    return require_model_dir(config)


def exact_tokens(n: int) -> SamplingParams:
    """Greedy, EOS ignored: exactly ``n`` output tokens (what docs/benchmarks/index.md pins)."""
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(num_tokens)]


def start_batch(
    engine: LLMEngine, rng: random.Random, tag: str, batch: int, context: int, max_tokens: int
) -> list[str]:
    """``batch`` decode-role requests whose ``context`` prompt tokens have KV and one token:
    ``add(prefill="remote")`` reserves the blocks, random values are written into them (as a
    KV transfer would: untouched zero pages would make the attention gather unrealistically
    cheap), then a first token is handed in and the KV declared arrived."""
    rids = [f"{tag}-{i}" for i in range(batch)]
    for rid in rids:
        prompt = random_prompt(rng, context, engine.vocab_size)
        engine.add(EngineRequest(rid, prompt, exact_tokens(max_tokens), prefill="remote"))
    engine.step()  # reserves blocks (no compute: nothing is runnable yet)
    reservations = engine.take_reservations()
    assert len(reservations) == batch, "pool too small for the batch"
    kv = engine.runner.kv_cache  # [num_blocks, L, 2, block_size, Hkv, D]
    template = torch.randn(kv.shape[1:], generator=torch.Generator().manual_seed(0))
    template = template.to(device=kv.device, dtype=kv.dtype)
    for res in reservations:
        kv[torch.tensor(res.block_ids, dtype=torch.long, device=kv.device)] = template
    for rid in rids:  # (a first token's text matters to the client only: none here)
        engine.kv_arrived(rid, [FirstToken(rng.randrange(17, engine.vocab_size), text="")])
    return rids


def grid(mode: str) -> dict[str, Any]:
    """The measured points of a ``mode`` (full, quick, smoke) run."""
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


def grid_engine(config: ClusterConfig, threads: int, points: dict[str, Any]) -> LLMEngine:
    """A decode-role engine with room for the grid's largest prompt and batch, chunking off."""
    block = config.cache.block_size
    longest = max(max(points["prefill"]), max(points["offsets"]) + points["chunk"])
    per_seq = -(-(max(points["context"]) + points["steps"] + 8) // block)
    blocks = max(max(points["batch"]) * per_seq, 2 * -(-longest // block)) + 32
    cfg = config.replace(
        {
            "model.num_threads": threads,
            "cache.num_blocks": blocks,
            "scheduler.chunk_size": None,
            "scheduler.max_num_batched_tokens": max(longest, 2048) + 64,
            "scheduler.max_num_seqs": max(max(points["batch"]), 8) + 1,
            "model.max_model_len": max(longest, max(points["context"])) + 64,
        }
    )
    return LLMEngine(cfg, role="decode")


def _timed_step(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def _abort_all(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
    _run_to_idle(engine)


def _run_to_idle(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _medians(points: dict[Any, list[float]]) -> dict[Any, float]:
    return {k: statistics.median(v) for k, v in points.items()}


class _StepProbe:
    """Times one engine's steps: each kind of point a method, the requests' ids and prompts
    drawn from one counter and one seeded RNG."""

    def __init__(self, engine: LLMEngine, points: dict[str, Any]) -> None:
        self.engine, self.points = engine, points
        self.rng = random.Random(11)
        self.vocab = engine.vocab_size
        self._ids: Iterator[int] = iter(range(1 << 30))

    def rid(self, tag: str) -> str:
        return f"{tag}{next(self._ids)}"

    def prompt(self, n: int) -> list[int]:
        return random_prompt(self.rng, n, self.vocab)

    def warm_up(self) -> None:
        """First-call allocations, the native kernels' first compile."""
        self.engine.add(EngineRequest("warm", self.prompt(64), exact_tokens(3)))
        _run_to_idle(self.engine)

    def prefill(self) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {t: [] for t in self.points["prefill"]}
        for rep in range(self.points["reps"]):
            sizes = self.points["prefill"] if rep % 2 == 0 else self.points["prefill"][::-1]
            for tokens in sizes:
                self.engine.add(EngineRequest(self.rid("p"), self.prompt(tokens), exact_tokens(1)))
                out[tokens].append(_timed_step(self.engine))
                _abort_all(self.engine)
        return out

    def context(self) -> dict[int, list[float]]:
        chunk = self.points["chunk"]
        out: dict[int, list[float]] = {o: [] for o in self.points["offsets"]}
        for _ in range(self.points["reps"]):
            for off in self.points["offsets"]:
                prefix = self.prompt(off)
                if off:  # cached for the next one
                    self.engine.add(EngineRequest(self.rid("c"), prefix, exact_tokens(1)))
                    _run_to_idle(self.engine)
                self.engine.add(
                    EngineRequest(self.rid("c"), prefix + self.prompt(chunk), exact_tokens(1))
                )
                out[off].append(_timed_step(self.engine))
                _abort_all(self.engine)
        return out

    def decode(self) -> dict[tuple[int, int], list[float]]:
        out: dict[tuple[int, int], list[float]] = {}
        cells = [(b, c) for b in self.points["batch"] for c in self.points["context"]]
        steps = self.points["steps"]
        for rep in range(self.points["reps"]):
            for b, c in cells if rep % 2 == 0 else cells[::-1]:
                rids = start_batch(self.engine, self.rng, self.rid("d"), b, c, steps + 4)
                self.engine.step()  # admits the batch
                times = [_timed_step(self.engine) for _ in range(steps)]
                out.setdefault((b, c), []).append(statistics.median(times))
                for rid in rids:
                    self.engine.abort_request(rid)
                _abort_all(self.engine)
        return out

    def mixed(self) -> list[dict[str, Any]]:
        p = self.points
        out = []
        for b, c, tokens in (
            (4, max(p["context"][0], 64), p["prefill"][2]),
            (max(p["batch"]) // 2 or 1, p["context"][-1], p["chunk"]),
        ):
            times = []
            for _ in range(p["reps"]):
                rids = start_batch(self.engine, self.rng, self.rid("m"), b, c, 8)
                self.engine.step()
                self.engine.add(EngineRequest(self.rid("m"), self.prompt(tokens), exact_tokens(1)))
                times.append(_timed_step(self.engine))
                for rid in rids:
                    self.engine.abort_request(rid)
                _abort_all(self.engine)
            out.append(
                {
                    "decode_batch": b,
                    "decode_context": c,
                    "prefill_tokens": tokens,
                    "measured_s": statistics.median(times),
                }
            )
        return out


def measure_steps(engine: LLMEngine, points: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Raw step times (seconds, medians) of one engine: prefill, context, decode, mixed."""
    probe = _StepProbe(engine, points)
    probe.warm_up()
    prefill = _medians(probe.prefill())
    progress("prefill: " + ", ".join(f"{t}: {v * 1e3:.0f} ms" for t, v in prefill.items()))
    context = _medians(probe.context())
    progress(
        f"chunk {points['chunk']} after context: "
        + ", ".join(f"{o}: {v * 1e3:.0f} ms" for o, v in context.items())
    )
    decode = _medians(probe.decode())
    progress("decode: " + ", ".join(f"b{b}/c{c}: {v * 1e3:.0f} ms" for (b, c), v in decode.items()))
    mixed = probe.mixed()
    engine.check_integrity()
    return {
        "prefill": {str(t): v for t, v in prefill.items()},
        "context": {str(o): v for o, v in context.items()},
        "decode": {f"{b},{c}": v for (b, c), v in decode.items()},
        "chunk": points["chunk"],
        "mixed": mixed,
    }


def step_costs(raw: dict[str, Any], points: dict[str, Any]) -> StepCosts:
    """The measured points as a cost table (the context term by least squares)."""
    chunk = raw["chunk"]
    offs = [int(o) for o in raw["context"]]
    base = raw["context"]["0"]
    pairs = [(o, raw["context"][str(o)] - base) for o in offs if o]
    # extra seconds = a * chunk * offset  ->  a = sum(x y) / sum(x x), x = chunk * offset
    num = sum(chunk * o * dt for o, dt in pairs)
    den = sum((chunk * o) ** 2 for o, _ in pairs)
    a = max(0.0, num / den) if den else 0.0
    batches, contexts = list(points["batch"]), list(points["context"])
    return StepCosts(
        tuple(float(t) for t in points["prefill"]),
        tuple(raw["prefill"][str(t)] for t in points["prefill"]),
        a,
        tuple(float(b) for b in batches),
        tuple(float(c) for c in contexts),
        tuple(tuple(raw["decode"][f"{b},{c}"] for c in contexts) for b in batches),
    )


TRANSFER_SIZES = (4, 64)  # blocks per timed pull
TRANSPORTS = (("shm", ("shm",), True), ("zmq", ("zmq",), True))  # name, transports, ipc


def _pull_times(
    sender: Any, receiver: Any, name: str, block_size: int, reps: int
) -> dict[int, float]:
    """Median seconds of a pull of each of ``TRANSFER_SIZES`` blocks (a first round warms up)."""
    times: dict[int, list[float]] = {n: [] for n in TRANSFER_SIZES}
    for rep in range(reps + 1):
        for n in TRANSFER_SIZES:
            ids = list(range(n))
            params = sender.register(f"{name}-{rep}-{n}", ids, num_tokens=n * block_size)
            t0 = time.perf_counter()
            receiver.pull(params, ids)
            if rep:  # the first round is a warm-up
                times[n].append(time.perf_counter() - t0)
    return _medians(times)


def measure_transfer(
    config: ClusterConfig, layout: KVLayout, progress: Progress, reps: int
) -> dict[str, TransferCost]:
    """Pulls of 4 and 64 blocks per transport, sender and receiver in this process."""
    from cluster.kv_transfer import KVPool, KVReceiver, KVSender

    out: dict[str, TransferCost] = {}
    cfg = dataclasses.replace(config.transfer, lease_s=30.0, heartbeat_s=5.0)
    src = KVPool.allocate(layout, max(TRANSFER_SIZES), shared=True)
    dst = KVPool.allocate(layout, max(TRANSFER_SIZES))
    assert src.bytes is not None
    src.bytes[:] = 7  # touched: no page faults while timed
    sender = KVSender(cfg, src, on_release=lambda rid, why: None)
    sender.start()
    try:
        for name, transports, ipc in TRANSPORTS:
            receiver = KVReceiver(dataclasses.replace(cfg, transports=transports, ipc=ipc), dst)
            receiver.start()
            try:
                med = _pull_times(sender, receiver, name, layout.block_size, reps)
            finally:
                receiver.close()
            (n0, n1), bpb = TRANSFER_SIZES, layout.bytes_per_block
            slope = max(1e-12, (med[n1] - med[n0]) / ((n1 - n0) * bpb))
            fixed = max(0.0, med[n0] - slope * n0 * bpb)
            out[name] = TransferCost(fixed, 1.0 / slope)
            progress(f"transfer {name}: {fixed * 1e3:.2f} ms + {1e-9 / slope:.2f} GB/s")
    finally:
        sender.close()
    return out
