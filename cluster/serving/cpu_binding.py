"""Pool replicas on cores of their own: a node-local claim on cores, and the process bound to it.

Why: a pull of KV blocks crosses threads inside each process (the caller, the receiver's or
sender's I/O thread, zmq's I/O thread) and each hand-off wakes a thread. Left to the scheduler,
the threads of both pools spread over every core and most wake-ups cross cores; on a virtual
machine that is an inter-processor interrupt each. Bound, small pulls get cheaper and scattered
ones over zmq ipc dearer (their per-message work shares one core per side, which is why the zmq
transport groups their frames); the measurements are in the docs (design decisions).

How (``cpu_binding: on``, which ``pdserve serve`` turns on in a Ray of its own):

  * ``claim_cores(n)`` takes the node's claim file (``pdserve-cpus-<uid>.json`` in the temp
    dir) under an exclusive ``flock``, drops the claims of processes that are gone (pid and
    start time: a reused pid is not mistaken for its predecessor), and claims the lowest ``n``
    cores of this process's allowed set that no live claim holds. None when fewer are free: the
    replica then runs unbound, as it would with ``cpu_binding: off``.
  * ``bind_process(cores)`` sets the affinity of every thread of this process; threads started
    later inherit it from the thread that starts them.
  * ``release()`` drops this process's claim (also at exit; a killed process's claim goes at
    the next claim by anyone).

Only pdserve's own replicas take part, so where other tenants share the node's cores (a Ray
cluster pdserve joined, a Kubernetes node without exclusive CPUs) binding stays off by default.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cluster.config import allowed_cores

logger = logging.getLogger(__name__)


def claim_file() -> Path:
    return Path(tempfile.gettempdir()) / f"pdserve-cpus-{os.getuid()}.json"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``), None if gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    fields = data[data.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, Any]]:
    """The claims in ``path``, locked; what the block leaves in them is written back."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            text = f.read()
            try:
                state = json.loads(text) if text.strip() else {}
            except ValueError:  # a torn or foreign file: start over rather than refuse to serve
                logger.warning("cpu binding: %s is unreadable; starting it afresh", path)
                state = {}
            claims = state.get("claims") if isinstance(state, dict) else None
            state = {"claims": claims if isinstance(claims, list) else []}
            yield state
            f.seek(0)
            f.truncate()
            f.write(json.dumps(state))
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _live(claims: list[Any]) -> list[dict[str, Any]]:
    live = []
    for c in claims:
        if not isinstance(c, dict) or not isinstance(c.get("cores"), list):
            continue
        pid, start = c.get("pid"), c.get("start")
        if isinstance(pid, int) and start is not None and start_time(pid) == start:
            live.append(c)
    return live


def claim_cores(n: int, *, path: Path | None = None) -> tuple[int, ...] | None:
    """Claim ``n`` cores of this process's allowed set that no live pdserve process holds."""
    if n < 1:
        raise ValueError(f"n: {n} cores; must be >= 1")
    path = path or claim_file()
    pid = os.getpid()
    with _locked(path) as state:
        claims = [c for c in _live(state["claims"]) if c["pid"] != pid]
        held = {core for c in claims for core in c["cores"]}
        free = [core for core in allowed_cores() if core not in held]
        cores = tuple(free[:n]) if len(free) >= n else None
        if cores is not None:
            claims.append({"pid": pid, "start": start_time(pid), "cores": list(cores)})
        state["claims"] = claims
    if cores is not None:
        atexit.register(release, path=path)
    return cores


def release(*, path: Path | None = None) -> None:
    """Drop this process's claim (if any)."""
    path = path or claim_file()
    pid = os.getpid()
    with contextlib.suppress(OSError), _locked(path) as state:
        state["claims"] = [c for c in _live(state["claims"]) if c["pid"] != pid]


def thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def bind_process(cores: Sequence[int]) -> None:
    """Every thread of this process on ``cores`` (threads it starts later inherit them)."""
    mask = set(cores)
    for tid in thread_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, mask)


def bind_replica(
    role: str, mode: str, num_threads: int | None, *, quiet: bool = False
) -> tuple[int, ...] | None:
    """A pool replica's binding (at start-up, before its engine starts threads; ``quiet``: a
    retry, which logs only success): the cores it holds, or None when it runs unbound (``mode``
    off or auto, no thread count, too few cores free)."""
    if mode != "on" or num_threads is None:
        return None
    cores = claim_cores(num_threads)
    if cores is None:
        if not quiet:  # a warning: it was to have cores of its own
            logger.warning(
                "%s replica: fewer than %d cores free of other pdserve replicas; running "
                "unbound (trying again now and then)",
                role,
                num_threads,
            )
        return None
    bind_process(cores)
    logger.info("%s replica (pid %d): bound to cores %s", role, os.getpid(), list(cores))
    return cores


def split_for_pools(cores: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Two disjoint halves of ``cores`` (the prefill side's, the decode side's), as the local
    launcher's even split of the cores between one replica of each pool places them; None when
    there are fewer than two."""
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return tuple(cores[:half]), tuple(cores[half:])
