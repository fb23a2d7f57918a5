"""A ``KVSender`` in a child process, driven over its stdin/stdout (``bench kv-transfer``, tests).

The parent sends length-prefixed msgpack messages (never pickle): first the spec, then commands,
each answered by one reply:

    spec {layout, num_blocks, shared?, seed?, transfer?, instance_id?, epoch?, quiet?, device?,
          cpus?}
                                                   -> {endpoint, ipc, pid}
    register {request_id, block_ids, num_tokens}   -> {params}
    abort {request_id}                             -> {ok}
    stats                                          -> {stats, released: [[request_id, reason]]}
    crc {block_ids}                                -> {crcs}
    exit                                           -> {ok}, then the child exits

``transfer`` is the config's ``transfer`` section; ``quiet`` (default true) hides the child's
stderr; ``cpus`` binds the child to those cores before it starts a thread (a pool replica bound
by ``cpu_binding``). The child's pool is filled with ``fill_pattern(seed)`` so a receiver can
check what landed without asking. The tests' peer (``tests/harness/kv_sender_peer.py``) runs
the same child with fault injectors: ``serve(spec, fault_points=..., faults=...)``.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgpack
import torch

from cluster.common.faults import FaultPoints
from cluster.common.kv_layout import KVLayout
from cluster.config import config_from_dict
from cluster.kv_transfer import KVPool, KVSender, KVTransferParams
from cluster.kv_transfer.framing import WireFaults
from cluster.kv_transfer.pool import TORCH_DTYPES
from cluster.kv_transfer.protocol import decode_params, from_plain, to_plain
from cluster.serving.cpu_binding import bind_process

_LEN = struct.Struct(">I")


def fill_pattern(pool: KVPool, seed: int, block_ids: Sequence[int] | None = None) -> None:
    """Write deterministic, block-distinct values (a function of seed and block id)."""
    ids = list(range(pool.num_blocks)) if block_ids is None else list(block_ids)
    for b in ids:
        pool.block_tensor(b, 1).copy_(pattern_block(pool.layout, seed, b))


def pattern_block(layout: KVLayout, seed: int, block_id: int) -> torch.Tensor:
    # [1, num_layers, 2, block_size, num_kv_heads, row_width]; int8 KV: its raw bytes
    dtype = TORCH_DTYPES[layout.storage_dtype]
    numel = layout.bytes_per_block // torch.empty((), dtype=dtype).element_size()
    values = torch.arange(numel, dtype=torch.int64) * 2654435761 + block_id * 40503 + seed * 9973
    if not dtype.is_floating_point:
        return (values % 251).to(dtype).view(1, *layout.block_shape)
    values = (values % 60013).to(torch.float32) / 7.0
    return values.to(dtype).view(1, *layout.block_shape)


def write_message(stream: IO[bytes], obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("peer closed its pipe")
    (n,) = _LEN.unpack(head)
    return msgpack.unpackb(stream.read(n), raw=False, strict_map_key=False)


# -- child side ------------------------------------------------------------------------------


def serve(
    spec: dict[str, Any],
    *,
    fault_points: FaultPoints | None = None,
    faults: WireFaults | None = None,
) -> None:
    """Run the sender of ``spec`` and answer commands on stdin until ``exit`` or EOF."""
    if spec.get("cpus"):
        bind_process(spec["cpus"])
    torch.set_num_threads(1)
    cfg = config_from_dict({"transfer": spec.get("transfer", {})})
    layout = from_plain(KVLayout, spec["layout"])
    pool = KVPool.allocate(
        layout,
        spec["num_blocks"],
        shared=spec.get("shared", False),
        device=spec.get("device", "cpu"),  # "cuda": a device pool (the cuda_ipc transport)
    )
    fill_pattern(pool, spec.get("seed", 0))
    released: list[list[str]] = []
    lock = threading.Lock()

    def on_release(request_id: str, reason: str) -> None:
        with lock:
            released.append([request_id, reason])

    sender = KVSender(
        cfg.transfer,
        pool,
        on_release=on_release,
        instance_id=spec.get("instance_id"),
        epoch=spec.get("epoch", 0),
        fault_points=fault_points,
        faults=faults,
    )
    sender.start()
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    write_message(
        out, {"endpoint": sender.endpoint, "ipc": sender.ipc_endpoint, "pid": os.getpid()}
    )
    while True:
        try:
            cmd = read_message(inp)
        except EOFError:
            break
        op = cmd.get("op")
        if op == "register":
            p = sender.register(cmd["request_id"], cmd["block_ids"], num_tokens=cmd["num_tokens"])
            write_message(out, {"params": to_plain(p)})
        elif op == "abort":
            write_message(out, {"ok": sender.abort(cmd["request_id"])})
        elif op == "stats":
            with lock:
                rel = list(released)
            stats = _plain(sender.stats())
            write_message(out, {"stats": stats, "released": rel, "alive": sender.is_alive()})
        elif op == "crc":
            write_message(out, {"crcs": pool.crc32(cmd["block_ids"])})
        else:
            break
    sender.close()
    write_message(out, {"ok": True})


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and obj == float("inf"):
        return 1e308
    return obj


# -- parent side -----------------------------------------------------------------------------


class SenderProcess:
    """Parent-side handle of a child running a ``KVSender``."""

    module = "benchmarks.kv_sender_peer"  # what the child runs (``python -m``)
    cwd: Path | None = None  # where it runs (None: here)
    spec_keys = frozenset(
        {
            "layout",
            "num_blocks",
            "shared",
            "seed",
            "transfer",
            "instance_id",
            "epoch",
            "quiet",
            "device",
            "cpus",
        }
    )

    def __init__(self, spec: dict[str, Any], *, start_timeout: float = 60.0) -> None:
        unknown = sorted(set(spec) - self.spec_keys)
        if unknown:
            raise ValueError(f"{type(self).__name__} spec: unknown keys {unknown}")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if spec.get("quiet", True) else None,
            cwd=self.cwd,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        write_message(self.proc.stdin, spec)
        self.info = self._reply(start_timeout)
        self.pid: int = self.info["pid"]
        self.endpoint: str = self.info["endpoint"]

    def _reply(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("the sender process did not answer")
        return read_message(self.proc.stdout)

    def call(self, cmd: dict[str, Any], timeout: float = 30.0) -> Any:
        assert self.proc.stdin is not None
        write_message(self.proc.stdin, cmd)
        return self._reply(timeout)

    def register(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int
    ) -> KVTransferParams:
        reply = self.call(
            {
                "op": "register",
                "request_id": request_id,
                "block_ids": list(block_ids),
                "num_tokens": num_tokens,
            }
        )
        return decode_params(reply["params"])

    def stats(self) -> dict[str, Any]:
        reply: dict[str, Any] = self.call({"op": "stats"})
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout=15)
                self.proc.wait(timeout=15)
            except (TimeoutError, EOFError, BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def wait_until(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> dict[str, Any]:
        """Poll ``stats()`` until ``predicate(stats)`` holds; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if predicate(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)


if __name__ == "__main__":
    serve(read_message(sys.stdin.buffer))
