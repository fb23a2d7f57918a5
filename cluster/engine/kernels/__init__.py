"""Small native kernels, compiled on first use with the system C compiler and cached.

No build step at install time: the C source is compiled into the pdserve cache directory the
first time a runner needs it (well under a second), keyed by the source's hash. Where no
compiler is available the runner falls back to the pure-torch path (same results).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
_MAX_GROUP = 64  # query heads per kv head the kernel's stack buffers hold
_PARALLEL_MIN_WORK = 16384  # (request, kv head) items x context tokens


def _compile(cache_dir: Path, source: Path = _SOURCE, flags: tuple[str, ...] = ()) -> Path | None:
    src = source.read_bytes()
    salt = platform.machine().encode() + (repr(flags).encode() if flags else b"")
    tag = hashlib.sha256(src + salt).hexdigest()
    target = cache_dir / "kernels" / f"{source.stem}-{tag[:16]}.so"
    if target.is_file():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, "-O3", "-march=native", *flags, "-fPIC", "-shared", "-o", tmp, str(source), "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: concurrent processes never load a partial file
    except (subprocess.SubprocessError, OSError) as e:
        logger.warning("could not compile the %s kernel (%s); using torch", source.stem, e)
        Path(tmp).unlink(missing_ok=True)
        return None
    return target


class PagedDecodeKernel:
    """Decode attention straight from the paged fp32 KV cache, split across threads."""

    def __init__(self, lib_path: Path, num_threads: int) -> None:
        lib = ctypes.CDLL(str(lib_path))
        fn = lib.pdserve_paged_decode_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            i64,
            i64,
        ]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib
        self.num_threads = max(1, num_threads)
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="paged-decode")

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        layer: int,
        scale: float,
    ) -> torch.Tensor:
        # q: [B, Hq, D] fp32 contiguous; tables: [B, max_blocks] int64; ctx_lens: [B] int64
        b, hq, d = q.shape
        _, num_layers, _, block_size, hkv, _ = kv_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        items = b * hkv
        args = (
            q.data_ptr(),
            kv_cache.data_ptr(),
            tables.data_ptr(),
            ctx_lens.data_ptr(),
            out.data_ptr(),
            hq,
            hkv,
            d,
            tables.shape[1],
            block_size,
            num_layers,
            layer,
            scale,
        )
        # Small steps run inline: a thread hand-off costs more than the work it would split.
        work = items * int(ctx_lens.max())
        n = min(self.num_threads, items) if work >= _PARALLEL_MIN_WORK else 1
        if n <= 1:
            self._check(self._fn(*args, 0, items))
            return out
        bounds = [items * i // n for i in range(n + 1)]
        futures = [self._pool.submit(self._fn, *args, bounds[i], bounds[i + 1]) for i in range(n)]
        for f in futures:
            self._check(f.result())
        return out

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its scratch buffer")


def load_paged_decode(
    cache_dir: Path, num_threads: int, num_heads: int, num_kv_heads: int
) -> PagedDecodeKernel | None:
    if num_heads // num_kv_heads > _MAX_GROUP:
        return None
    path = _compile(cache_dir)
    if path is None:
        return None
    try:
        return PagedDecodeKernel(path, num_threads)
    except OSError as e:
        logger.warning("could not load the paged decode kernel (%s); using torch", e)
        return None
