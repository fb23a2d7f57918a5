"""P4 ``kv-transfer``: the data plane, pool to pool between two processes (docs/benchmarks).

The KV of 32 / 512 / 1024 prompt tokens of the default model's layout (fp32, 30 layers, 3 KV
heads, head dim 64, block 16: 737,280 bytes per block) moves from a prefill pool in a child
process into a decode pool here. Arms, interleaved, in an order shuffled afresh each repetition
(``arm_order``; seeded, so a run repeats):

  * ``memcpy``: one contiguous copy in this process (the physical reference);
  * ``raw_zmq_ipc`` / ``raw_zmq_tcp``: one contiguous buffer requested from a child and received
    zero-copy, no pool (the transport's own limit);
  * ``shm``, ``zmq_ipc``, ``zmq_tcp``: ``KVReceiver.pull`` of the blocks from a ``KVSender``
    child into this pool's blocks, control round trips included; source and destination are
    the first blocks of each pool (contiguous: consecutive runs coalesce into few frames);
  * ``shm_frag``, ``zmq_ipc_frag``, ``zmq_tcp_frag``: the same pulls on fragmented block tables,
    as after churn and prefix hits: source and destination ids drawn at random (shuffled, fresh
    each repetition) from pools twice the largest transfer, so almost no two blocks adjoin;
  * ``int8_shm``, ``int8_zmq_ipc``: the contiguous pulls of the same tokens in the int8 KV layout
    (``cache.kv_dtype: int8``: head_dim int8 values and one fp32 scale per token and KV head,
    68 bytes a row instead of 256 at head dim 64), from a second sender child;
  * ``hmac_zmq_tcp``, ``curve_zmq_tcp``: the contiguous zmq tcp pull with ``transfer.auth:
    hmac`` (an HMAC-SHA256 over each message's header and payload, signed and checked) and with
    ``transfer.auth: curve`` (zmq CURVE: every frame encrypted and authenticated), each from a
    sender child of its own: what authenticating the KV costs against ``zmq_tcp``.

Why shuffled, not rotated: with the order rotated, every arm always ran right after the same
other arm, and what that arm left behind moved it. In one shuffled run here (60 repetitions),
``int8_zmq_ipc`` took 2.87 ms after ``int8_shm`` (which had just written the same destination
blocks, still in cache) and 3.21 ms over all predecessors; ``zmq_ipc`` took 8.76 ms after
``shm``, 8.35 ms over all. Those were exactly the rotation's predecessors: on one host the same
day, ``int8_transfer_ms_ratio_512`` read 0.345-0.351 in 5 rotated runs and 0.359-0.395 in 9
shuffled ones (2 pairs of them alternating). A pull in service lands in blocks that no pull
just wrote.

Placement: the prefill side (the sender children and the raw peer) and the decode side (this
process, its receivers' threads included) each run on cores of their own, the halves of this
process's cores (``cpu_binding.split_for_pools``), as ``pdserve serve`` binds one replica of each
pool (``cpu_binding: on`` in a Ray of its own); with one core, both run unbound. This process
gets its cores back when the arms are done. Unbound (before 2026-12-05), the threads of both
sides woke each other across cores: ``int8_transfer_ms_ratio_512`` read 0.358-0.389 in nine runs
that day, bound 0.306-0.320 in three (int8 2.62-2.66 ms against 3.02-3.17 unbound); the
fragmented zmq ipc pulls, one message per block, went the other way (12.8-13.5 ms against
8.9-9.4), and won part of it back once the transport grouped their frames into a few messages
(``transports/zmq_frames.py``).

Times are medians; a key is a ratio of two arms measured side by side (reference / ours as a
throughput ratio). ``transfer_share_of_prefill_*`` divides the zmq ipc transfer time by the
prefill time of a prompt of the same length on the real model (skipped in ``--smoke``).
``int8_transfer_ms_ratio_512`` is the int8 zmq ipc pull time over the fp32 one at 512 tokens
(lower is better; the shm ratio is in the details).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import zmq

from benchmarks.harness import BenchContext, BenchReport, interleaved_order, percentile
from benchmarks.kv_sender_peer import SenderProcess
from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.config import allowed_cores
from cluster.kv_transfer import KVPool, KVReceiver
from cluster.serving.cpu_binding import bind_process, split_for_pools

SIZES = (32, 512, 1024)
ARMS = (
    "memcpy",
    "raw_zmq_ipc",
    "raw_zmq_tcp",
    "shm",
    "zmq_ipc",
    "zmq_tcp",
    "shm_frag",
    "zmq_ipc_frag",
    "zmq_tcp_frag",
    "int8_shm",
    "int8_zmq_ipc",
    "hmac_zmq_tcp",
    "curve_zmq_tcp",
)
AUTHS = ("hmac", "curve")  # the arms' prefixes that name a transfer.auth mode
HMAC_SECRET = "pdserve-bench-kv-transfer-secret"  # the hmac arm's (both sides, this run only)
POOL_FACTOR = 2  # pool blocks per block of the largest transfer (room to fragment)
DEFAULT_LAYOUT = KVLayout("SmolLM2-135M-Instruct", "float32", 16, 30, 3, 64)
SMOKE_LAYOUT = KVLayout("pdserve-smoke", "float32", 16, 2, 2, 16)
TARGETS = {
    "shm_vs_memcpy_512": ">= 0.4",
    "zmq_ipc_vs_raw_512": ">= 0.8",
    "zmq_tcp_vs_raw_512": ">= 0.8",
    "zmq_ipc_vs_raw_32": ">= 0.6",
    "zmq_ipc_vs_raw_512_frag": ">= 0.8 (as contiguous)",
    "shm_vs_memcpy_512_frag": ">= 0.4 (as contiguous)",
    "transfer_share_of_prefill_512": "<= 0.05",
    "transfer_share_of_prefill_1024": "<= 0.05",
    "int8_transfer_ms_ratio_512": "<= 0.35",
    "hmac_zmq_tcp_vs_none_512": ">= 0.8",
    "curve_zmq_tcp_vs_none_512": ">= 0.8",
}


def auth_spec(auth: str) -> dict[str, str]:
    """The transfer settings of an authenticated arm (a fresh CURVE keypair per run)."""
    if auth == "hmac":
        return {"auth": "hmac", "hmac_secret": HMAC_SECRET}
    public, secret = zmq.curve_keypair()
    return {
        "auth": "curve",
        "curve_public_key": public.decode("ascii"),
        "curve_secret_key": secret.decode("ascii"),
    }


def arm_order(rep: int) -> tuple[str, ...]:
    """Repetition ``rep``'s order of the arms (see the module's docstring)."""
    return interleaved_order(ARMS, rep)


def int8_layout(layout: KVLayout) -> KVLayout:
    return dataclasses.replace(layout, dtype="int8", quantization=SCHEMES["int8"])


class RawClient:
    """Requests ``size`` bytes and receives them zero-copy: what the transport alone can do."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def fetch(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.sock.send(str(nbytes).encode())
        frame = self.sock.recv(copy=False)
        elapsed = time.perf_counter() - t0
        assert len(frame) == nbytes
        return elapsed


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The run's layouts and pool sizes, and the transfer settings every sender and receiver
    shares."""

    layout: KVLayout
    q_layout: KVLayout  # the int8 arms'
    max_blocks: int  # of the largest transfer
    pool_blocks: int
    cfg: Any  # TransferConfig

    @property
    def transfer_spec(self) -> dict[str, Any]:
        return {
            "transports": ["shm", "zmq"],
            "lease_s": self.cfg.lease_s,
            "heartbeat_s": self.cfg.heartbeat_s,
            "frame_bytes": self.cfg.frame_bytes,
            "max_message_bytes": self.cfg.max_message_bytes,
        }


def _shape(ctx: BenchContext) -> _Shape:
    layout = SMOKE_LAYOUT if ctx.smoke else DEFAULT_LAYOUT
    max_blocks = -(-max(SIZES) // layout.block_size)
    # A lease long enough for any pull here, under the drain timeout the config requires.
    cfg = dataclasses.replace(
        ctx.config.transfer, lease_s=50.0, heartbeat_s=5.0, transfer_timeout_s=60.0
    )
    return _Shape(layout, int8_layout(layout), max_blocks, POOL_FACTOR * max_blocks, cfg)


class _Peers:
    """Both sides of every arm: the sender children (fp32 and int8 pools) and the raw peer on
    the prefill side's cores, this process's pools, receivers and raw clients."""

    def __init__(self, shape: _Shape, prefill_cores: tuple[int, ...]) -> None:
        layout, q_layout, cfg = shape.layout, shape.q_layout, shape.cfg
        auths = {auth: auth_spec(auth) for auth in AUTHS}
        self.senders = {
            name: SenderProcess(
                {
                    "layout": dataclasses.asdict(lay),
                    "num_blocks": shape.pool_blocks,
                    "shared": True,
                    "transfer": spec,
                    "cpus": list(prefill_cores),
                }
            )
            for name, lay, spec in (
                (layout.dtype, layout, shape.transfer_spec),
                (q_layout.dtype, q_layout, shape.transfer_spec),
                *((auth, layout, {**shape.transfer_spec, **spec}) for auth, spec in auths.items()),
            )
        }
        self.raw = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.raw_zmq_peer",
                str(shape.max_blocks * layout.bytes_per_block),
                ",".join(map(str, prefill_cores)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.raw.stdout is not None
        raw_endpoints = json.loads(self.raw.stdout.readline())
        self.zctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.zctx.linger = 0
        self.pool = KVPool.allocate(layout, shape.pool_blocks)
        q_pool = KVPool.allocate(q_layout, shape.max_blocks)
        assert self.pool.bytes is not None
        shm_cfg = dataclasses.replace(cfg, transports=("shm",), ipc=True)
        ipc_cfg = dataclasses.replace(cfg, transports=("zmq",), ipc=True)
        self.receivers = {
            "shm": KVReceiver(shm_cfg, self.pool),
            "zmq_ipc": KVReceiver(ipc_cfg, self.pool),
            "zmq_tcp": KVReceiver(
                dataclasses.replace(cfg, transports=("zmq",), ipc=False), self.pool
            ),
            "int8_shm": KVReceiver(shm_cfg, q_pool),
            "int8_zmq_ipc": KVReceiver(ipc_cfg, q_pool),
            **{
                f"{auth}_zmq_tcp": KVReceiver(
                    dataclasses.replace(cfg, transports=("zmq",), ipc=False, **spec), self.pool
                )
                for auth, spec in auths.items()
            },
        }
        for r in self.receivers.values():
            r.start()
        self.raws = {
            "raw_zmq_ipc": RawClient(raw_endpoints["ipc"], self.zctx),
            "raw_zmq_tcp": RawClient(raw_endpoints["tcp"], self.zctx),
        }

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        for c in self.raws.values():
            c.sock.close(linger=0)
        self.zctx.term()
        for s in self.senders.values():
            s.close()
        assert self.raw.stdin is not None
        self.raw.stdin.close()
        self.raw.wait(timeout=10)


class _Arms:
    """Each arm's one timed transfer of ``n`` tokens (``measures``)."""

    def __init__(self, shape: _Shape, peers: _Peers) -> None:
        self.shape, self.peers = shape, peers
        self.frag_rng = random.Random(4)
        self.counter = iter(range(1 << 30))
        self.src_buf = np.full(shape.max_blocks * shape.layout.bytes_per_block, 3, dtype=np.uint8)

    def pull(self, arm: str, n: int, ids: list[int]) -> float:
        src = dst = ids
        if arm.endswith("_frag"):
            src = self.frag_rng.sample(range(self.shape.pool_blocks), len(ids))
            dst = self.frag_rng.sample(range(self.shape.pool_blocks), len(ids))
        prefix = arm.split("_")[0]
        sender = self.peers.senders[
            prefix if prefix in ("int8", *AUTHS) else self.shape.layout.dtype
        ]
        params = sender.register(f"{arm}-{next(self.counter)}", src, num_tokens=n)
        t0 = time.perf_counter()
        result = self.peers.receivers[arm.removesuffix("_frag")].pull(params, dst)
        elapsed = time.perf_counter() - t0
        assert (
            result.transport
            == (arm.split("_", 1)[1] if prefix in ("int8", *AUTHS) else arm).split("_")[0]
        )
        return elapsed

    def memcpy(self, nbytes: int) -> float:
        assert self.peers.pool.bytes is not None
        flat = self.peers.pool.bytes.reshape(-1)
        t0 = time.perf_counter()
        np.copyto(flat[:nbytes], self.src_buf[:nbytes])
        return time.perf_counter() - t0

    def measures(self, n: int) -> dict[str, Callable[[], float]]:
        ids = list(range(-(-n // self.shape.layout.block_size)))
        nbytes = len(ids) * self.shape.layout.bytes_per_block
        out: dict[str, Callable[[], float]] = {
            "memcpy": partial(self.memcpy, nbytes),
            "raw_zmq_ipc": partial(self.peers.raws["raw_zmq_ipc"].fetch, nbytes),
            "raw_zmq_tcp": partial(self.peers.raws["raw_zmq_tcp"].fetch, nbytes),
        }
        for arm in ARMS:
            out.setdefault(arm, partial(self.pull, arm, n, ids))
        return out


Times = dict[tuple[str, int], list[float]]


def _measure(ctx: BenchContext, arms: _Arms, reps: int, warmup: int) -> Times:
    """Every size's arms, interleaved in a shuffled order per repetition; warm-ups dropped."""
    times: Times = {(a, n): [] for a in ARMS for n in SIZES}
    for n in SIZES:
        measure = arms.measures(n)
        for rep in range(warmup + reps):
            for arm in arm_order(rep):
                t = measure[arm]()
                if rep >= warmup:
                    times[(arm, n)].append(t)
        nbytes = -(-n // arms.shape.layout.block_size) * arms.shape.layout.bytes_per_block
        ctx.progress(
            f"{n} tokens ({nbytes / 1e6:.1f} MB): "
            + ", ".join(f"{a} {statistics.median(times[(a, n)]) * 1e3:.2f} ms" for a in ARMS)
        )
    return times


def run(ctx: BenchContext) -> BenchReport:
    torch.set_num_threads(1)
    shape = _shape(ctx)
    reps, warmup = ctx.pick(60, 20, 2), ctx.pick(5, 3, 1)
    ctx.progress(
        f"layout {shape.layout}, {shape.layout.bytes_per_block} bytes per block "
        f"(int8: {shape.q_layout.bytes_per_block}); starting peers"
    )
    # Placement: the prefill side (the children) and the decode side (this process) on cores of
    # their own, as ``pdserve serve`` binds one replica of each pool (``cpu_binding``).
    original = allowed_cores()
    split = split_for_pools(original)
    prefill_cores, decode_cores = split if split is not None else ((), ())
    ctx.progress(f"cores: prefill side {list(prefill_cores)}, decode side {list(decode_cores)}")
    peers = _Peers(shape, prefill_cores)
    if decode_cores:
        bind_process(decode_cores)  # every thread of the bench (receivers' too), until `finally`
    try:
        times = _measure(ctx, _Arms(shape, peers), reps, warmup)
        sender_stats = {dtype: s.stats()["stats"] for dtype, s in peers.senders.items()}
    finally:
        peers.close()
        if decode_cores:
            bind_process(original)  # the benchmarks after this one run as before
    cores = {"prefill_side": list(prefill_cores), "decode_side": list(decode_cores)}
    return _report(ctx, shape, times, reps, {"cores": cores, "sender": sender_stats})


def _report(
    ctx: BenchContext, shape: _Shape, times: Times, reps: int, run_details: dict[str, Any]
) -> BenchReport:
    bpb, q_layout = shape.layout.bytes_per_block, shape.q_layout
    med = {k: statistics.median(v) for k, v in times.items()}
    keys = {
        "shm_vs_memcpy_512": med[("memcpy", 512)] / med[("shm", 512)],
        "zmq_ipc_vs_raw_512": med[("raw_zmq_ipc", 512)] / med[("zmq_ipc", 512)],
        "zmq_tcp_vs_raw_512": med[("raw_zmq_tcp", 512)] / med[("zmq_tcp", 512)],
        "zmq_ipc_vs_raw_32": med[("raw_zmq_ipc", 32)] / med[("zmq_ipc", 32)],
        # Fragmented tables against the same references: what scattering costs.
        "zmq_ipc_vs_raw_512_frag": med[("raw_zmq_ipc", 512)] / med[("zmq_ipc_frag", 512)],
        "shm_vs_memcpy_512_frag": med[("memcpy", 512)] / med[("shm_frag", 512)],
        # the wire between processes: int8 KV blocks (scales inside) vs fp32, zmq ipc
        "int8_transfer_ms_ratio_512": med[("int8_zmq_ipc", 512)] / med[("zmq_ipc", 512)],
        # authenticated (hmac over header and payload) vs not, zmq tcp: a throughput ratio
        "hmac_zmq_tcp_vs_none_512": med[("zmq_tcp", 512)] / med[("hmac_zmq_tcp", 512)],
        "curve_zmq_tcp_vs_none_512": med[("zmq_tcp", 512)] / med[("curve_zmq_tcp", 512)],
    }
    details: dict[str, Any] = {
        "layout": dataclasses.asdict(shape.layout),
        "int8_layout": dataclasses.asdict(q_layout),
        "int8_bytes_ratio": q_layout.bytes_per_block / bpb,
        "int8_shm_ms_ratio_512": med[("int8_shm", 512)] / med[("shm", 512)],
        "reps": reps,
        "pool_blocks": shape.pool_blocks,
        "cores": run_details["cores"],
        "zmq_tcp_vs_raw_512_frag": med[("raw_zmq_tcp", 512)] / med[("zmq_tcp_frag", 512)],
        "sender": run_details["sender"],
    }
    if not ctx.smoke:
        prefill = _prefill_times(ctx, (512, 1024), ctx.pick(3, 2, 1))
        details["prefill_s"] = prefill
        for n in (512, 1024):
            keys[f"transfer_share_of_prefill_{n}"] = med[("zmq_ipc", n)] / prefill[n]
            details[f"shm_share_of_prefill_{n}"] = med[("shm", n)] / prefill[n]
    table = []
    for n in SIZES:
        for arm in ARMS:
            arm_bpb = q_layout.bytes_per_block if arm.startswith("int8_") else bpb
            nbytes = -(-n // shape.layout.block_size) * arm_bpb
            table.append(
                {
                    "tokens": n,
                    "arm": arm,
                    "MB": nbytes / 1e6,
                    "median_ms": med[(arm, n)] * 1e3,
                    "p90_ms": percentile(times[(arm, n)], 90) * 1e3,
                    "GB/s": nbytes / med[(arm, n)] / 1e9,
                }
            )
    details["times_s"] = {f"{a}/{n}": v for (a, n), v in times.items()}
    return BenchReport(keys=keys, table=table, details=details, targets=TARGETS)


def _prefill_times(ctx: BenchContext, lengths: tuple[int, ...], reps: int) -> dict[int, float]:
    """Median time to first token of an n-token prompt on the real model (max_tokens=1)."""
    from cluster import LLM
    from cluster.common.sampling_params import SamplingParams

    ctx.progress("loading the default model to time prefill")
    llm = LLM(config=ctx.config.replace({"cache.num_blocks": 160}))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng(0)
    llm.generate([list(range(100, 164))], params)  # warm-up
    out: dict[int, float] = {}
    for n in lengths:
        samples = []
        for _ in range(reps):
            prompt = [int(t) for t in rng.integers(100, 20000, size=n)]  # never a cache hit
            t0 = time.perf_counter()
            llm.generate([prompt], params)
            samples.append(time.perf_counter() - t0)
        out[n] = statistics.median(samples)
        ctx.progress(f"prefill {n} tokens: {out[n] * 1e3:.0f} ms")
    return out
