"""Test-only launcher: pool workers as real processes on 127.0.0.1 (reliability matrix, Harness)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import child_env
from cluster.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    role: str
    popen: subprocess.Popen[bytes]
    endpoint: str
    pid: int
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def alive(self) -> bool:
        return self.popen.poll() is None


def start_worker(
    role: str,
    config: ClusterConfig,
    workdir: Path,
    prefill: list[str] = (),
    name: str = "",
    ports: tuple[int, int] = (0, 0),  # (rpc, kv): fixed, to restart a worker at its address
) -> Worker:
    name = name or role
    ready = workdir / f"{name}.ready"
    ready.unlink(missing_ok=True)  # a stale file would name a dead worker's endpoint
    log = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "tests.harness.worker",
        role,
        "--config-json",
        json.dumps(config.to_dict()),
        "--ready-file",
        str(ready),
    ]
    for ep in prefill:
        cmd += ["--prefill", ep]
    cmd += ["--rpc-port", str(ports[0]), "--kv-port", str(ports[1])]
    env = child_env(ROOT, OMP_NUM_THREADS="1")
    with log.open("wb") as out:
        popen = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            popen.kill()
            raise TimeoutError(f"{name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    info: dict[str, Any] = json.loads(ready.read_text())
    return Worker(role, popen, info["endpoint"], info["pid"], log)


def stop_workers(workers: list[Worker]) -> None:
    for w in workers:
        if w.alive():
            w.kill(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for w in workers:
        try:
            w.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill(signal.SIGKILL)
            w.popen.wait(timeout=10)
