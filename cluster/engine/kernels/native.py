"""The native library's functions on torch tensors (CPU, fp32 activations, rows contiguous).

One ``NativeKernels`` per model runner: the linear kernel over every weight format (F32 and
the packed ones of ``quant.py``), the row de-quantization the tiles path and packed embeddings
use, the per-layer ops (RMSNorm, RoPE, SwiGLU, the KV write), and paged decode attention over
fp32 or int8 KV. Every call releases the GIL and splits its work on the library's own thread
pool (``num_threads`` threads, the caller one of them).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from cluster.engine.kernels.library import load_library
from cluster.engine.kernels.quant import F32, FAST, INT8_ROW, QUANT_NAMES

ISA_NAMES = ("portable", "avx2", "avx512")
# The integer (int8-activation) kernels' variants, ``qlinear.c``: AVX-512 with and without VNNI.
QLINEAR_ISA_NAMES = ("portable", "avx2", "avx512bw", "avx512vnni")

# Argument types, one letter each: i int, l int64, p pointer, f float (the C prototypes:
# native.h); every function returns int.
_TYPES = {"i": ctypes.c_int, "l": ctypes.c_int64, "p": ctypes.c_void_p, "f": ctypes.c_float}
_SIGNATURES = {
    "pdserve_linear": "ipplllpllplpii",
    "pdserve_dequant_rows": "ipplllpllpli",
    "pdserve_rms_norm": "plpplllfi",
    "pdserve_rope": "pllllppp",
    "pdserve_swiglu": "plllpl",
    "pdserve_write_kv": "pppllpplllllli",
    "pdserve_paged_decode": "ppppplllllllllfii",
    "pdserve_isa": "",
    "pdserve_set_isa": "i",
    "pdserve_qlinear_isa": "",
    "pdserve_set_qlinear_isa": "i",
}


@functools.cache
def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with every function's argument types set (once per library)."""
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_TYPES[a] for a in args]
        fn.restype = ctypes.c_int
    return lib


# The level each loaded library uses, read once and updated by set_isa: the linear path's rule
# reads it on every call, a dict lookup instead of a call into the library.
_ISA: dict[int, str] = {}


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeKernels:
    """See the module docstring. Tensors are passed by address: the caller keeps them alive
    and gives rows with unit stride inside a row."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._lib = _bound(lib)
        self.num_threads = max(1, num_threads)

    @property
    def lib(self) -> ctypes.CDLL:
        return self._lib

    @property
    def isa(self) -> str:
        """The instruction set the library's functions use now (the best this CPU has, unless
        capped by ``set_isa``)."""
        isa = _ISA.get(self._lib._handle)
        if isa is None:
            isa = _ISA[self._lib._handle] = ISA_NAMES[self._lib.pdserve_isa()]
        return isa

    def set_isa(self, name: str | None) -> str:
        """Cap the instruction set of every function (tests run each variant the CPU has);
        None: the best. Process-wide: the library is loaded once."""
        level = -1 if name is None else ISA_NAMES.index(name)
        isa = _ISA[self._lib._handle] = ISA_NAMES[self._lib.pdserve_set_isa(level)]
        return isa

    @property
    def qlinear_isa(self) -> str:
        """The variant the integer kernels (``model.numerics: fast``) use now."""
        return QLINEAR_ISA_NAMES[self._lib.pdserve_qlinear_isa()]

    def set_qlinear_isa(self, name: str | None) -> str:
        """Cap the integer kernels' variant (tests run each one the CPU has); None: the best.
        Process-wide, and under ``set_isa``'s cap too."""
        level = -1 if name is None else QLINEAR_ISA_NAMES.index(name)
        return QLINEAR_ISA_NAMES[self._lib.pdserve_set_qlinear_isa(level)]

    def linear(
        self,
        qtype: int,
        data: torch.Tensor,  # [rows, row_bytes] uint8 (F32: [rows, cols] fp32)
        scales: torch.Tensor | None,  # [rows] fp32 (int8 rows only)
        cols: int,
        x: torch.Tensor,  # [n, cols] fp32
        out: torch.Tensor,  # [n, >= rows] fp32
        bias: torch.Tensor | None = None,  # [rows] fp32
        accumulate: bool = False,  # out += x W^T (+ bias) instead of out =
    ) -> torch.Tensor:
        if x.shape[1] != cols or out.shape[0] != x.shape[0] or out.shape[1] < data.shape[0]:
            raise ValueError(
                f"linear: x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a "
                f"[{data.shape[0]}, {cols}] weight"
            )
        rc = self._lib.pdserve_linear(
            qtype,
            data.data_ptr(),
            _ptr_of(scales),
            data.shape[0],
            cols,
            data.stride(0) * data.element_size(),
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            _ptr_of(bias),
            int(accumulate),
            self.num_threads,
        )
        if rc == -2:
            raise MemoryError("linear: no memory for the activations' block sums")
        if rc != 0:
            base, fast = qtype & ~FAST, " with int8 activations (FAST)" if qtype & FAST else ""
            raise ValueError(f"linear: unsupported weight {QUANT_NAMES.get(base, base)}{fast}")
        return out

    def dequant(
        self,
        qtype: int,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        cols: int,
        out: torch.Tensor,  # [count, >= cols] fp32
        row0: int = 0,
        row_ids: torch.Tensor | None = None,  # [count] int64, or rows row0 .. row0 + count
    ) -> torch.Tensor:
        """Rows of a packed weight as fp32, exactly ``quant.dequantize``'s values."""
        if qtype == F32:
            raise ValueError("dequant: F32 rows are already fp32")
        if qtype == INT8_ROW and scales is None:
            raise ValueError("dequant: int8 rows need their scales")
        count = row_ids.shape[0] if row_ids is not None else out.shape[0]
        rc = self._lib.pdserve_dequant_rows(
            qtype,
            data.data_ptr(),
            _ptr_of(scales),
            data.shape[0],
            cols,
            data.stride(0),
            _ptr_of(row_ids),
            row0,
            count,
            out.data_ptr(),
            out.stride(0),
            self.num_threads,
        )
        if rc == -2:
            raise IndexError(f"dequant: a row id outside [0, {data.shape[0]})")
        if rc != 0:
            raise ValueError(f"dequant: unsupported weight {QUANT_NAMES.get(qtype, qtype)}")
        return out

    # -- the per-layer ops around the linears ---------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) per row: [N, H] -> [N, H]."""
        out = torch.empty_like(x)
        n, h = x.shape
        self._lib.pdserve_rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), h, n, h, eps,
            self.num_threads,
        )  # fmt: skip
        return out

    def rope(
        self,
        qkv: torch.Tensor,  # [N, (Hq + 2 Hkv) * D]; the first num_heads heads rotate in place
        num_heads: int,
        head_dim: int,
        cos: torch.Tensor,  # [max_len, D]
        sin: torch.Tensor,
        positions: torch.Tensor,  # [N] int64
    ) -> None:
        self._lib.pdserve_rope(
            qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, head_dim, cos.data_ptr(),
            sin.data_ptr(), positions.data_ptr(),
        )  # fmt: skip

    def swiglu(self, gu: torch.Tensor, inter: int) -> torch.Tensor:
        """silu(gate) * up of [N, 2 * inter] rows -> [N, inter]."""
        out = torch.empty((gu.shape[0], inter), dtype=torch.float32)
        self._lib.pdserve_swiglu(
            gu.data_ptr(), gu.stride(0), gu.shape[0], inter, out.data_ptr(), inter
        )
        return out

    def write_kv(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, Hkv, row_width] fp32 or uint8
        layer: int,
        k: torch.Tensor,  # [N, Hkv * D] rows (views into qkv), row stride ld
        v: torch.Tensor,
        slot_blocks: torch.Tensor,  # [N] int64
        slot_offsets: torch.Tensor,
        head_dim: int,
    ) -> None:
        _, num_layers, _, block_size, hkv, _ = kv_cache.shape
        self._lib.pdserve_write_kv(
            kv_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.shape[0],
            slot_blocks.data_ptr(), slot_offsets.data_ptr(), num_layers, layer, block_size, hkv,
            row_heads(kv_cache), head_dim, int(kv_cache.dtype == torch.uint8),
        )  # fmt: skip

    # -- attention ------------------------------------------------------------------------------

    def paged_decode(
        self,
        q: torch.Tensor,  # [B, Hq, D] fp32
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, Hkv, width] fp32 or uint8
        tables: torch.Tensor,  # [B, max_blocks] int64
        ctx_lens: torch.Tensor,  # [B] int64
        layer: int,
        scale: float,
    ) -> torch.Tensor:
        """Decode attention of each row over its context, read in place from the paged cache
        (fp32 rows, or int8 rows and their scales): [B, Hq, D]."""
        b, hq, d = q.shape
        _, num_layers, _, block_size, hkv, _ = kv_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        rc = self._lib.pdserve_paged_decode(
            q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), ctx_lens.data_ptr(),
            out.data_ptr(), b, hq, hkv, row_heads(kv_cache), d, tables.shape[1], block_size,
            num_layers, layer, scale, int(kv_cache.dtype == torch.uint8), self.num_threads,
        )  # fmt: skip
        if rc == -2:
            raise ValueError(f"paged decode: {hq // hkv} query heads per kv head (at most 64)")
        if rc != 0:
            raise MemoryError("paged decode: no memory for the scores")
        return out


MAX_GROUP = 64  # query heads per kv head paged_decode takes (PD_MAX_GROUP)


def row_heads(kv_cache: torch.Tensor) -> int:
    """The heads one token's row holds in memory: the cache's own, or, for a tensor-parallel
    rank's view of its heads in a cache holding every rank's (``kv[..., h0:h1, :]``), all of
    them. Any other layout is refused: the kernels address rows by these strides."""
    _, layers, two, bs, hkv, width = kv_cache.shape
    heads = kv_cache.stride(3) // width if width else hkv
    expected = (layers * two * bs * heads * width, two * bs * heads * width, bs * heads * width)
    if (
        kv_cache.stride(5) != 1
        or kv_cache.stride(4) != width
        or kv_cache.stride(3) != heads * width
        or heads < hkv
        or tuple(kv_cache.stride()[:3]) != expected
    ):
        raise ValueError(
            f"kv cache: strides {kv_cache.stride()} are not a paged cache's, nor a head range of "
            f"one (shape {tuple(kv_cache.shape)})"
        )
    return heads


def load_native(cache_dir: Path, num_threads: int) -> NativeKernels | None:
    """The native library's functions, or None (the reason is logged: ``library.py``)."""
    loaded = load_library(cache_dir)
    return NativeKernels(loaded.lib, num_threads) if loaded.lib is not None else None
