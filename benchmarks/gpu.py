"""P10 ``gpu``: the GPU run, one command (``pdserve bench gpu``), about 8 minutes on one H200.

Only where a CUDA device is lent: without one it stops at once with a clear error. In order,
each part under its own time limit, its figures into one report:

  1. exactness: ``pytest -m gpu tests/gpu`` (the engine on CUDA against transformers on CUDA,
     chunked prefill and preemption, a cuda_ipc pull between two processes bit-identical, and
     a prefill and a decode worker process on the one GPU token-identical to the offline LLM);
  2. P6 ``decode-scaling`` in ``--quick`` mode on the device;
  3. P10 roofline: decode step time at batch 1..256 (context 512, prompt KV synthetic), against
     the HBM roofline of the device: (weight bytes + the batch's KV bytes read per step) /
     bandwidth, with the bandwidth a device-to-device copy measures here (and the datasheet
     figure where the device is known); ``roofline_b<B>`` = roofline time / measured time;
  4. the same-GPU hand-off: a ``KVSender`` in a child process with its pool on the device and a
     ``KVReceiver`` here, over ``cuda_ipc``: two processes on one GPU cannot form an NCCL pair
     (NCCL refuses two ranks on one device), so the same-GPU hand-off is CUDA IPC (one device
     copy, pool to pool); ``handoff_vs_device_copy_<n>`` = a plain device copy of the same bytes
     / the pull (docs/benchmarks/index.md P10: >= 0.5);
  5. ``pdserve profile`` (quick, the engine steps and transfers) into
     ``bench/results/profile-gpu.json`` for ``pdserve plan --profile``.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchContext, BenchReport, child_env

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT = 512
HANDOFF_TOKENS = (512, 2048)
# Datasheet HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
NO_CUDA = (
    "bench gpu: needs a CUDA device, and torch.cuda.is_available() is False here (a CPU "
    "machine, or a CPU build of torch): run it on a machine with a GPU"
)
ROOT = Path(__file__).resolve().parents[1]


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(NO_CUDA)


def run(ctx: BenchContext) -> BenchReport:
    require_cuda()
    import torch

    name = torch.cuda.get_device_name(0)
    ctx.progress(f"device: {name}")
    keys: dict[str, float] = {}
    details: dict[str, Any] = {"device": name, "parts": {}}
    table: list[dict[str, Any]] = []
    cfg = ctx.config.replace({"model.device": "cuda"})

    t0 = time.monotonic()
    ok, out = _pytest_gpu(ctx)
    keys["exactness_tests_passed"] = 1.0 if ok else 0.0
    details["parts"]["exactness"] = {"passed": ok, "tail": out[-4000:], "s": time.monotonic() - t0}

    t0 = time.monotonic()
    p6 = _decode_scaling(ctx, cfg)
    keys.update({f"p6_{k}": v for k, v in p6.keys.items()})
    details["parts"]["decode_scaling"] = {"s": time.monotonic() - t0, **p6.details}

    t0 = time.monotonic()
    roof = _roofline(ctx, cfg)
    keys.update(roof["keys"])
    table.extend(roof["rows"])
    details["parts"]["roofline"] = {"s": time.monotonic() - t0, **roof["details"]}

    t0 = time.monotonic()
    hand = _handoff(ctx, cfg)
    keys.update(hand["keys"])
    table.extend(hand["rows"])
    details["parts"]["handoff"] = {"s": time.monotonic() - t0}

    t0 = time.monotonic()
    from cluster.planner.measure.profiler import run_profile

    prof_path = ctx.results_dir / "profile-gpu.json"
    run_profile(cfg, "quick", prof_path, serving=False, progress=ctx.progress)
    details["parts"]["profile"] = {"s": time.monotonic() - t0, "path": str(prof_path)}
    return BenchReport(
        keys=keys,
        table=table,
        details=details,
        targets={
            "exactness_tests_passed": "1",
            "handoff_vs_device_copy_2048": ">= 0.5",
            "roofline_b1": "(share of the HBM roofline)",
        },
    )


def _pytest_gpu(ctx: BenchContext) -> tuple[bool, str]:
    ctx.progress("pytest -m gpu tests/gpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(ROOT),
    )
    out = proc.stdout + proc.stderr
    ctx.progress(
        out.strip().splitlines()[-1] if out.strip() else f"pytest exited {proc.returncode}"
    )
    return proc.returncode == 0, out


def _decode_scaling(ctx: BenchContext, cfg: Any) -> BenchReport:
    from benchmarks import decode_scaling

    ctx.progress("P6 decode-scaling (quick) on the device")
    sub = BenchContext(name="decode-scaling", mode="quick", config=cfg)
    sub.results_dir = ctx.results_dir
    return decode_scaling.run(sub)


def device_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes moved per second by a device-to-device copy (read + write counted)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def roofline_seconds(
    weight_bytes: int, kv_bytes_per_token: float, batch: int, context: float, bandwidth: float
) -> float:
    """The least time a decode step can take: every weight and the batch's KV read once."""
    return (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth


def weight_bytes_per_step(model: Any) -> int:
    """What one decode step reads of the weights: every layer's, the final norm, the LM head
    (the embedding table only for the batch's rows: left out)."""
    total = sum(
        t.numel() * t.element_size()
        for layer in model.layers
        for f in dataclasses.fields(layer)
        if (t := getattr(layer, f.name)) is not None
    )
    for t in (model.final_norm, model.lm_head):
        total += t.numel() * t.element_size()
    return int(total)


def _roofline(ctx: BenchContext, cfg: Any) -> dict[str, Any]:
    import torch

    from benchmarks.workloads import bench_model_dir
    from cluster.engine.engine import LLMEngine
    from cluster.planner.measure.engine import start_batch

    ctx.progress("P10: decode step time vs the HBM roofline")
    steps = 8
    block = cfg.cache.block_size
    per_seq = -(-(CONTEXT + steps + 8) // block)
    engine = LLMEngine(
        cfg.replace(
            {
                "model.path": str(bench_model_dir(ctx)),
                "cache.num_blocks": max(BATCHES) * per_seq + 16,
                "scheduler.max_num_seqs": max(BATCHES),
                "scheduler.max_num_batched_tokens": max(2048, max(BATCHES)),
            }
        ),
        role="decode",
    )
    weights = weight_bytes_per_step(engine.runner.model)  # type: ignore[attr-defined]
    kv_per_token = engine.runner.layout.bytes_per_block / block
    bw = device_copy_bandwidth()
    nominal = next(
        (v for k, v in NOMINAL_BANDWIDTH.items() if k in torch.cuda.get_device_name(0)), None
    )
    rng = random.Random(3)
    rows, keys = [], {}
    for b in BATCHES:
        rids = start_batch(engine, rng, f"roof{b}", b, CONTEXT, steps + 4)
        engine.step()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        for rid in rids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        step = statistics.median(times)
        roof = roofline_seconds(weights, kv_per_token, b, CONTEXT + steps / 2, bw)
        keys[f"roofline_b{b}"] = roof / step
        rows.append(
            {
                "part": "roofline",
                "batch": b,
                "step_ms": step * 1e3,
                "roofline_ms": roof * 1e3,
                "share": roof / step,
                "tok_s": b / step,
            }
        )
        ctx.progress(
            f"b{b}: {step * 1e3:.2f} ms ({b / step:.0f} tok/s), roofline {roof * 1e3:.2f} ms"
        )
    engine.check_integrity()
    return {
        "keys": keys,
        "rows": rows,
        "details": {
            "weight_bytes": weights,
            "kv_bytes_per_token": kv_per_token,
            "copy_bandwidth_Bps": bw,
            "nominal_bandwidth_Bps": nominal,
        },
    }


def _handoff(ctx: BenchContext, cfg: Any) -> dict[str, Any]:
    """cuda_ipc pulls between two processes on this GPU vs a device copy of the same bytes."""
    import torch

    from benchmarks.kv_sender_peer import SenderProcess
    from cluster.common.kv_layout import KVLayout
    from cluster.kv_transfer import KVPool, KVReceiver

    ctx.progress("same-GPU hand-off: cuda_ipc between two processes")
    layout = KVLayout("SmolLM2-135M-Instruct", "bfloat16", 16, 30, 3, 64)
    n_max = -(-max(HANDOFF_TOKENS) // layout.block_size)
    tcfg = dataclasses.replace(
        cfg.transfer,
        transports=("cuda_ipc",),
        lease_s=50.0,
        heartbeat_s=5.0,
        transfer_timeout_s=60.0,
    )
    sender = SenderProcess(
        {
            "layout": dataclasses.asdict(layout),
            "num_blocks": n_max,
            "device": "cuda",
            "transfer": {"transports": ["cuda_ipc"], "lease_s": 50.0, "heartbeat_s": 5.0},
        }
    )
    pool = KVPool.allocate(layout, n_max, device="cuda")
    receiver = KVReceiver(tcfg, pool)
    receiver.start()
    rows, keys = [], {}
    try:
        for n in HANDOFF_TOKENS:
            blocks = -(-n // layout.block_size)
            ids = list(range(blocks))
            pulls, copies = [], []
            src = torch.empty_like(pool.tensor[:blocks])
            for rep in range(12):
                params = sender.register(f"h{n}-{rep}", ids, num_tokens=n)
                t0 = time.perf_counter()
                result = receiver.pull(params, ids)
                pulls.append(time.perf_counter() - t0)
                assert result.transport == "cuda_ipc"
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pool.tensor[:blocks].copy_(src)
                torch.cuda.synchronize()
                copies.append(time.perf_counter() - t0)
            pull, copy = statistics.median(pulls[2:]), statistics.median(copies[2:])
            keys[f"handoff_vs_device_copy_{n}"] = copy / pull
            nbytes = blocks * layout.bytes_per_block
            rows.append(
                {
                    "part": "handoff",
                    "tokens": n,
                    "MB": nbytes / 1e6,
                    "pull_ms": pull * 1e3,
                    "copy_ms": copy * 1e3,
                    "ratio": copy / pull,
                }
            )
    finally:
        receiver.close()
        sender.close()
    return {"keys": keys, "rows": rows}
