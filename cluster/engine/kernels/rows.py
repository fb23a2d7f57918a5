"""Linear layers for a few rows (decode steps, draft verification): ``rows_linear.c``.

A step that decodes or verifies drafts multiplies each weight matrix by a handful of rows. On
CPUs where the BLAS gemm is slow for a small M (here 2 rows cost 2x one, 9 cost 2.5x), this
kernel streams each weight row once per tile of input rows and stays within ~1.3x of one row
at 4 rows and ~1.7x at 8. Each output is summed in one fixed order whatever the number of rows
(batch invariance): a decode row's logits are bitwise the same alone, in a batch, or as one of
the rows verifying drafts, so greedy speculation reproduces greedy decoding exactly.

Used for 1 <= rows <= ``MAX_ROWS`` on the CPU fp32 native path; larger steps (prefill chunks)
go to the fallback linear. The work is split over output features across threads (the call
runs without the GIL), inline when small.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cluster.engine.kernels import compile_kernel

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("rows_linear.c")
MAX_ROWS = 32  # rows up to which the kernel beat the BLAS gemm where measured (README)
_PARALLEL_MIN_WEIGHTS = 1 << 18  # weight elements (1 MiB fp32) below which one thread does it

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class RowsLinear:
    """``linear(x, w, b)`` for x [..., K] fp32: the kernel for up to ``MAX_ROWS`` rows."""

    def __init__(self, lib_path: Path, num_threads: int, fallback: Linear) -> None:
        lib = ctypes.CDLL(str(lib_path))
        fn = lib.pdserve_rows_linear_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib
        self.fallback = fallback
        self.num_threads = max(1, num_threads)
        self._pool = (
            ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="rows-linear")
            if self.num_threads > 1
            else None
        )

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 1 <= rows <= MAX_ROWS or x.dtype != torch.float32 or w.dtype != torch.float32:
            return self.fallback(x, w, b)
        x2 = x.reshape(rows, k).contiguous()  # [M, K]
        w = w.contiguous()  # [N, K]
        n = w.shape[0]
        y = torch.empty((rows, n), dtype=torch.float32, device=x.device)  # [M, N]
        bias = b.contiguous() if b is not None else None
        args = (x2.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None)
        out = y.data_ptr()
        parts = (
            self.num_threads if self._pool is not None and w.numel() >= _PARALLEL_MIN_WEIGHTS else 1
        )
        # Split on multiples of 4 output features (the kernel's tile), the caller takes the first.
        bounds = [min(n, (n * i // parts + 3) // 4 * 4) for i in range(parts)] + [n]
        futures = [
            self._pool.submit(self._fn, *args, out, rows, n, k, bounds[i], bounds[i + 1])
            for i in range(1, parts)
            if self._pool is not None
        ]
        self._fn(*args, out, rows, n, k, bounds[0], bounds[1])
        for f in futures:
            f.result()
        return y.view(*x.shape[:-1], n)


def rows_linear(cache_dir: Path, num_threads: int, fallback: Linear) -> Linear | None:
    """The rows kernel in front of ``fallback``; None where it cannot be compiled or loaded."""
    path = compile_kernel(_SOURCE, cache_dir, ("-O3", "-march=native", "-ffp-contract=off"))
    if path is None:
        return None
    try:
        return RowsLinear(path, num_threads, fallback)
    except OSError as e:
        logger.warning("could not load the rows linear kernel (%s); using the fallback", e)
        return None
