"""``pdserve serve``'s guard: nothing the launcher started outlives it, even a SIGKILL (F13).

A local Ray's GCS and raylet end with their driver, but its dashboard and runtime-env agents and
some worker processes are reparented to init and live on when the driver is killed. The guard is
a small child process started before Ray (``start``): it records the launcher's process tree
every ``POLL_S``, and once the launcher is gone it gives Ray's own shutdown ``grace_s``, then
SIGKILLs every process it saw in that tree that still runs (same pid *and* start time: never a
recycled pid). It ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group; the
guard must outlive its launcher to clean up after it) and exits once done.

    python -m cluster.launcher_guard <launcher pid> [grace_s]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.25


def start(grace_s: float = 3.0) -> subprocess.Popen[bytes]:
    """Start the guard of this process (call before starting Ray)."""
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.launcher_guard", str(os.getpid()), str(grace_s)],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


def _tree(launcher: psutil.Process, me: int) -> dict[int, float]:
    seen = {}
    for p in launcher.children(recursive=True):
        if p.pid != me:
            with contextlib.suppress(psutil.Error):
                seen[p.pid] = p.create_time()
    return seen


def guard(launcher_pid: int, grace_s: float) -> int:
    me = os.getpid()
    seen: dict[int, float] = {}
    try:
        launcher = psutil.Process(launcher_pid)
    except psutil.Error:
        return 0
    while os.getppid() == launcher_pid:  # reparented: the launcher is gone
        try:
            seen.update(_tree(launcher, me))
        except psutil.Error:
            break
        time.sleep(POLL_S)
    deadline = time.monotonic() + grace_s
    left = dict(seen)
    while left:
        for pid, started in list(left.items()):
            try:
                p = psutil.Process(pid)
                if p.create_time() != started or p.status() == psutil.STATUS_ZOMBIE:
                    del left[pid]
                elif time.monotonic() >= deadline:
                    p.kill()
                    del left[pid]
            except psutil.Error:
                del left[pid]
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(guard(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 3.0))
