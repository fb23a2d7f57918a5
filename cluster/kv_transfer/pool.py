"""A pool's KV cache as the data plane sees it: whole blocks as contiguous byte ranges.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, row_width], contiguous

so ``kv_cache[b : b + n]`` is one contiguous region of ``n * layout.bytes_per_block`` bytes that
a transport sends or fills in place. ``KVPool.allocate(..., shared=True)`` puts the pool in a
memfd that a same-host receiver maps read-only (the ``shm`` transport: one copy, pool to pool),
after checking that the path the peer named is such a memfd (``MappedPool``).
A memfd has no name in /dev/shm, so a SIGKILLed sender leaks nothing: the memory goes away with
the last process that maps it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from cluster.common import shared_regions
from cluster.common.kv_layout import KVLayout

# A shared pool's memfd (its name in /proc/<pid>/fd links) and the only path a peer may name.
MEMFD_NAME = "pdserve-kv-pool"
_SHARED_PATH = re.compile(r"/proc/([1-9][0-9]{0,9})/fd/([0-9]{1,9})")

# by KVLayout.storage_dtype (int8 KV is raw bytes: int8 values with their fp32 scales)
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}


def _prefault(region: mmap.mmap) -> None:
    """Write every page of a fresh memfd mapping once, now.

    A memfd's pages are allocated on first write; left to the engine, that write is the KV of
    a prompt, and each of its blocks (180 pages at the default layout) page-faults inside the
    step (the docs' design decisions have the cost). A private pool is written at allocation
    too (``torch.zeros``), so this costs no memory the other does not.
    """
    np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0


class KVPool:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, *, shm_path: str = "") -> None:
        expected = layout.block_shape
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:]) != expected:
            raise ValueError(
                f"kv_cache: shape {tuple(kv_cache.shape)} does not match the layout "
                f"[num_blocks, {', '.join(map(str, expected))}]"
            )
        if kv_cache.dtype != TORCH_DTYPES[layout.storage_dtype]:
            raise ValueError(
                f"kv_cache: dtype {kv_cache.dtype} but the layout stores {layout.storage_dtype}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache: must be contiguous (one block = one byte range)")
        self.tensor = kv_cache
        self.layout = layout
        self.num_blocks = int(kv_cache.shape[0])
        self.bytes_per_block = layout.bytes_per_block
        self.shm_path = shm_path  # /proc/<pid>/fd/<n> of the memfd holding the pool, or ""
        self._memfd = -1
        # [num_blocks, bytes_per_block] uint8 over the same memory (CPU pools; the zmq and shm
        # paths need host memory, torch_dist works on the tensor itself).
        self.bytes: np.ndarray | None = None
        if kv_cache.device.type == "cpu":
            self.bytes = kv_cache.view(torch.uint8).view(self.num_blocks, -1).numpy()

    @classmethod
    def allocate(
        cls, layout: KVLayout, num_blocks: int, *, shared: bool = False, device: str = "cpu"
    ) -> KVPool:
        """A zeroed pool; ``shared`` backs it with a memfd a same-host receiver can map."""
        shape = (num_blocks, *layout.block_shape)
        dtype = TORCH_DTYPES[layout.storage_dtype]
        if not shared:
            return cls(torch.zeros(shape, dtype=dtype, device=device), layout)
        if device != "cpu":
            raise ValueError("a shared KV pool lives in host memory (device must be cpu)")
        nbytes = num_blocks * layout.bytes_per_block
        region, fd, path = shared_regions.new_region(MEMFD_NAME, nbytes)
        try:
            _prefault(region)
        except BaseException:
            os.close(fd)
            raise
        tensor = torch.frombuffer(region, dtype=dtype).view(shape)
        pool = cls(tensor, layout, shm_path=path)
        pool._memfd = fd
        # the engine's tensor-parallel ranks map this cache too (cluster.common.shared_regions)
        shared_regions.register(tensor.data_ptr(), pool.shm_path, fd)
        return pool

    def check_range(self, start: int, count: int) -> bool:
        return count >= 1 and start >= 0 and start + count <= self.num_blocks

    def byte_view(self, start: int, count: int) -> np.ndarray:
        """[count, bytes_per_block] uint8 view of blocks ``start .. start + count - 1``."""
        assert self.bytes is not None, "byte views need a CPU pool"
        return self.bytes[start : start + count]

    def block_tensor(self, start: int, count: int) -> torch.Tensor:
        # [count, num_layers, 2, block_size, num_kv_heads, row_width], a view
        return self.tensor[start : start + count]

    def crc32(self, block_ids: Sequence[int]) -> list[int]:
        """Per-block crc32 (integrity checks in tests and debugging)."""
        assert self.bytes is not None
        return [zlib.crc32(self.bytes[b]) for b in block_ids]

    def close(self) -> None:
        """Drop the memfd descriptor; the memory lives on while the tensor or a peer maps it."""
        if self._memfd >= 0:
            shared_regions.forget(self.tensor.data_ptr())
            os.close(self._memfd)
            self._memfd = -1
            self.shm_path = ""


def _open_shared(path: str, owner_pid: int, nbytes: int) -> int:
    """A read-only descriptor of the pool a same-host peer names, once it is sure to be one.

    The path comes from the peer, so it is confined to how ``KVPool.allocate`` names its pool:
    ``/proc/<the peer's pid>/fd/<n>``, a memfd (it has no other name, and that link must be
    followed, so O_NOFOLLOW cannot be used). The target is stat'ed to be a regular file before
    it is opened (a FIFO or device is never opened), opened non-blocking, and the object opened
    must be a pdserve pool memfd of the expected size. Anything else: ``ValueError`` naming it.
    """
    match = _SHARED_PATH.fullmatch(path)
    if match is None or int(match[1]) != owner_pid:
        raise ValueError(
            f"shared pool path {path!r} is not /proc/{owner_pid}/fd/<n> (the sender's memfd)"
        )
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"shared pool {path}: not a regular file (a FIFO, device or socket)")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)  # of what was opened: the link may have changed since the stat
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(st.st_mode) or target != f"/memfd:{MEMFD_NAME} (deleted)":
            raise ValueError(f"shared pool {path}: {target!r} is not a pdserve KV pool memfd")
        if st.st_size != nbytes:
            raise ValueError(f"shared pool {path}: {st.st_size} bytes, expected {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


class MappedPool:
    """A same-host sender's shared pool, mapped read-only by a receiver (never written).

    ``owner_pid`` is the sender's pid: the only process whose memfd the path may name.
    """

    def __init__(self, path: str, num_blocks: int, bytes_per_block: int, owner_pid: int) -> None:
        nbytes = num_blocks * bytes_per_block
        fd = _open_shared(path, owner_pid, nbytes)
        try:
            self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        # [num_blocks, bytes_per_block] uint8, read-only
        self.bytes: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint8).reshape(
            num_blocks, bytes_per_block
        )
        self.num_blocks = num_blocks

    def close(self) -> None:
        self.bytes = None
        # A view may still be alive somewhere; then the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._map.close()
