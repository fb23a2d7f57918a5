"""The other ranks of a tensor-parallel engine: processes on the driver's host.

The engine's process is rank 0 (the driver): it schedules, samples and owns the KV cache's
memory. Ranks 1..n-1 are child processes started here (``python -m cluster.engine.tp_rank_main``:
a fresh interpreter that imports nothing of the caller's script, with its spec as JSON on
stdin). Each loads the model, keeps its shard (``models.tensor_parallel``), maps the driver's
KV cache (shared memory) and then runs every step the driver broadcasts, taking part in the
step's collectives (``tp_group.ShmGroup``) and discarding its logits.

A rank reports ``ready`` or the error that stopped its start-up as one JSON line on its
stdout; a rank that dies later is seen by the driver's collectives (``peer_alive``), which
fail the step with the rank's exit code. A rank whose driver is gone exits at its next wait.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ClusterConfig, config_from_dict

logger = logging.getLogger(__name__)

STOP = "stop"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank process is started with."""

    rank: int
    world: int
    group_path: str
    config: ClusterConfig
    model_dir: str | None
    driver_pid: int
    wake_fd: int = -1  # the eventfd rank 0 writes after each message (inherited, same number)

    def to_json(self) -> str:
        data = {
            "rank": self.rank,
            "world": self.world,
            "group_path": self.group_path,
            "config": self.config.to_dict(),
            "model_dir": self.model_dir,
            "driver_pid": self.driver_pid,
            "wake_fd": self.wake_fd,
        }
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        data = json.loads(text)
        data["config"] = config_from_dict(data["config"])
        return cls(**data)


class Ranks:
    """The driver's handle on its other ranks' processes."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], wake_fds: list[int]) -> None:
        self.procs = procs
        self.wake_fds = wake_fds  # rank 0's ends of each rank's wake-up eventfd

    def wait_ready(self, timeout_s: float) -> None:
        """Until every rank has loaded its shard; RuntimeError naming the first that failed."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, 1):
            line = _read_line(proc, deadline)
            if line is None:
                raise RuntimeError(f"tensor-parallel rank {rank}: not ready in {timeout_s} s")
            if not line:
                proc.wait(5.0)
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited ({proc.returncode}) while starting"
                )
            report = json.loads(line)
            if report["kind"] != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {report['text']}")

    def peer_alive(self) -> str | None:
        """None while every rank runs; else which died, with its exit code."""
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} exited ({proc.returncode})"
        return None

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the ranks (the driver broadcast ``STOP`` first where it could)."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
            if proc.stdout is not None:
                proc.stdout.close()
        for fd in self.wake_fds:
            os.close(fd)
        self.wake_fds = []


def spawn_ranks(
    config: ClusterConfig, model_dir: Path | None, group_path: str, world: int
) -> Ranks:
    procs, wake_fds = [], []
    for rank in range(1, world):
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        wake_fds.append(wake)
        spec = RankSpec(
            rank,
            world,
            group_path,
            config,
            str(model_dir) if model_dir else None,
            os.getpid(),
            wake,
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.engine.tp_rank_main"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(wake,),
        )
        assert proc.stdin is not None
        proc.stdin.write(spec.to_json().encode())
        proc.stdin.close()
        procs.append(proc)
    return Ranks(procs, wake_fds)


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
    """The rank's report line; b"" if it closed its stdout first, None past ``deadline``."""
    assert proc.stdout is not None
    fd, line = proc.stdout.fileno(), b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b""
            line += chunk
    return line


def driver_gone(driver_pid: int) -> str | None:
    """For a rank's waits: the driver's death (the rank was re-parented)."""
    return None if os.getppid() == driver_pid else "the tensor-parallel driver exited"
