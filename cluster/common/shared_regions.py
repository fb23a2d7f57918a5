"""Which memory of this process lives in a shared region another process on the host may map.

A KV cache allocated in a memfd (the shm transport's pool, a tensor-parallel engine's cache) is
registered here by its address with the path others open (``/proc/<pid>/fd/<fd>``), so the
engine can hand that path to its other ranks whoever allocated the memory. Torch-free: addresses
and paths only.
"""

from __future__ import annotations

import mmap
import os
import threading

_lock = threading.Lock()
_regions: dict[int, tuple[str, int]] = {}


def new_region(name: str, nbytes: int) -> tuple[mmap.mmap, int, str]:
    """A zeroed memfd of ``nbytes``, mapped here: (the mapping, its fd, the path another process
    on this host opens to map it: ``map_region``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)  # zero-filled
        region = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return region, fd, f"/proc/{os.getpid()}/fd/{fd}"


def map_region(path: str, nbytes: int) -> mmap.mmap:
    """Another process's region (``new_region``'s path), read-write."""
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), nbytes)


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
