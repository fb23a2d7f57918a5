"""Small native kernels, compiled on first use with the system C compiler and cached.

No build step at install time: the C source is compiled into the pdserve cache directory the
first time a runner needs it (about a second), keyed by the source's hash, the compiler flags
and the CPU's instruction-set flags (a cache shared between hosts never hands one CPU a binary
built for another's instructions). Where no compiler is available the runner falls back to
the pure-torch path (same results).
"""

from __future__ import annotations

import ctypes
import functools
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


@functools.cache
def cpu_fingerprint() -> str:
    """What a binary built for this CPU may rely on: the machine and its instruction-set flags.

    Part of every kernel's cache key, so a cache directory shared between hosts (a home
    directory, an image layer) never hands a ``-march=native`` build to a CPU that lacks one
    of its instructions.
    """
    parts = [platform.machine(), platform.system()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("flags", "Features", "isa", "vendor_id", "model name", "CPU part"):
                parts.append(line)
                if key in ("flags", "Features"):
                    break
    except OSError:
        parts.append(platform.processor())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def compile_kernel(
    source: Path,
    cache_dir: Path,
    flags: tuple[str, ...],
    also: tuple[Path, ...] = (),
) -> Path | None:
    """``source`` (with the sources and headers in ``also``) built into ``cache_dir/kernels``
    once per (their text, flags, CPU), or None."""
    src = b"".join(p.read_bytes() for p in (source, *also))
    key = src + " ".join(flags).encode() + cpu_fingerprint().encode()
    tag = hashlib.sha256(key).hexdigest()[:16]
    target = cache_dir / "kernels" / f"{source.stem}-{tag}.so"
    if target.is_file():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    sources = [str(p) for p in (source, *also) if p.suffix == ".c"]
    cmd = [cc, *flags, "-fPIC", "-shared", "-o", tmp, *sources, "-lm", "-lpthread"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        os.replace(tmp, target)  # atomic: concurrent processes never load a partial file
    except (subprocess.SubprocessError, OSError) as e:
        logger.warning("could not compile %s (%s); using torch", source.name, e)
        Path(tmp).unlink(missing_ok=True)
        return None
    return target


def _compile(cache_dir: Path) -> Path | None:
    return compile_kernel(
        _SOURCE, cache_dir, ("-O3", "-march=native"), (_SOURCE.with_name("vec_exp.h"),)
    )


class PagedDecodeKernel:
    """Decode attention straight from the paged KV cache (fp32, or int8 rows with their scales,
    de-quantized as they are read), split across threads."""

    def __init__(self, lib_path: Path, num_threads: int, int8: bool = False) -> None:
        lib = ctypes.CDLL(str(lib_path))
        fn = lib.pdserve_paged_decode_i8 if int8 else lib.pdserve_paged_decode_f32
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
        self._lens: torch.Tensor | None = None
        self._max_len = 0
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
        # (Every layer of a step passes the same ctx_lens: its max is read once a step.)
        if ctx_lens is not self._lens:
            self._lens, self._max_len = ctx_lens, int(ctx_lens.max())
        work = items * self._max_len
        n = min(self.num_threads, items) if work >= _PARALLEL_MIN_WORK else 1
        if n <= 1:
            self._check(self._fn(*args, 0, items))
            return out
        bounds = [items * i // n for i in range(n + 1)]
        futures = [self._pool.submit(self._fn, *args, bounds[i], bounds[i + 1]) for i in range(n)]
        for f in futures:
            self._check(f.result())
        return out

    @property
    def address(self) -> int:
        """The C function itself (``decode_forward.c`` calls it for every layer)."""
        value = ctypes.cast(self._fn, ctypes.c_void_p).value
        assert value is not None
        return value

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise MemoryError("paged decode kernel could not allocate its scratch buffer")


def load_paged_decode(
    cache_dir: Path, num_threads: int, num_heads: int, num_kv_heads: int, int8: bool = False
) -> PagedDecodeKernel | None:
    if num_heads // num_kv_heads > _MAX_GROUP:
        return None
    path = _compile(cache_dir)
    if path is None:
        return None
    try:
        return PagedDecodeKernel(path, num_threads, int8)
    except OSError as e:
        logger.warning("could not load the paged decode kernel (%s); using torch", e)
        return None
