"""Which memory of this process lives in a shared region another process on the host may map.

A KV cache allocated in a memfd (the shm transport's pool, a tensor-parallel engine's cache) is
registered here by its address with the path others open (``/proc/<pid>/fd/<fd>``), so the
engine can hand that path to its other ranks whoever allocated the memory. Torch-free: addresses
and paths only.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_regions: dict[int, tuple[str, int]] = {}


def register(address: int, path: str, fd: int = -1) -> None:
    """The region starting at ``address`` can be mapped at ``path`` (``fd``: the memfd kept open
    for it, -1 where its owner keeps it)."""
    with _lock:
        _regions[address] = (path, fd)


def path_of(address: int) -> str | None:
    with _lock:
        entry = _regions.get(address)
    return entry[0] if entry is not None else None


def forget(address: int) -> int:
    """No longer mappable from here; returns the region's registered fd (-1: none) for its
    owner to close."""
    with _lock:
        entry = _regions.pop(address, None)
    return entry[1] if entry is not None else -1
