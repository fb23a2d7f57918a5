"""Quantized weight formats, their torch de-quantization, and the native linear kernel over them.

Formats (one row of ``row_bytes`` bytes per output feature; ggml's type ids for the GGUF ones):

    Q4_0 (2):  blocks of 32: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
    Q4_1 (3):  blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
    Q8_0 (8):  blocks of 32: fp16 d, 32 int8                      w = d * q
    int8 (1000, ours): int8 per value, one fp32 scale per row     w = s * q
    int8g32 (1001, ours): blocks of 32: fp16 d, fp16 m, 32 uint8  w = d * q + m

Block types are held *planar* in memory (``to_planar``): a row of nb blocks is its nb value
groups (16 or 32 bytes each), then its nb fp16 d, then (Q4_1, int8g32) its nb fp16 m. The same
bytes as GGUF's interleaved blocks, reordered so the kernels read sixteen blocks' scales in one
load; ``PackedWeight.of`` takes the interleaved blocks and reorders them once, at load time.

``dequantize`` (torch, any device) is the reference and the portable fallback; the native
kernel (``quant_linear.c``) multiplies fp32 activations by the packed rows without expanding
them, using the best instruction set the CPU has (probed at run time inside the one binary).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from cluster.engine.kernels import compile_kernel

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0, INT8_ROW, INT8_G32 = 2, 3, 8, 1000, 1001
QUANT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", INT8_ROW: "int8", INT8_G32: "int8g32"}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, INT8_G32: 36}  # per 32 values
BLOCK = 32
ISA_NAMES = ("portable", "avx2", "avx512")

_SOURCE = Path(__file__).with_name("quant_linear.c")
# compiled into the same library: the whole decode step's layers in one call, and the header
_ALSO = (
    Path(__file__).with_name("decode_forward.c"),
    Path(__file__).with_name("quant_linear.h"),
    Path(__file__).with_name("vec_exp.h"),
)
# Portable code plus per-function AVX2 / AVX-512 variants chosen from cpuid at run time, so no
# -march=native: the binary runs on any CPU of its architecture. No fp contraction: d * q + m
# rounds twice, exactly as the de-quantizing reference computes it.
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-strict-aliasing")


def row_bytes(qtype: int, cols: int) -> int:
    if qtype == INT8_ROW:
        return cols
    return cols // BLOCK * BLOCK_BYTES[qtype]


def _scale_bytes(qtype: int) -> int:
    """Bytes of a block's scales: fp16 d, and fp16 m where the type has a minimum."""
    return 4 if qtype in (Q4_1, INT8_G32) else 2


def to_planar(qtype: int, blocks: torch.Tensor) -> torch.Tensor:
    """[rows, row_bytes] interleaved blocks (GGUF's order: each block's scales, then its values)
    -> the same bytes planar: every block's values, then every d, then every m."""
    if qtype == INT8_ROW:
        return blocks.contiguous()
    rows, sb = blocks.shape[0], _scale_bytes(qtype)
    b = blocks.reshape(rows, -1, BLOCK_BYTES[qtype])
    parts = [b[..., sb:].reshape(rows, -1), b[..., 0:2].reshape(rows, -1)]
    if sb == 4:
        parts.append(b[..., 2:4].reshape(rows, -1))
    return torch.cat(parts, dim=1).contiguous()


def to_blocks(qtype: int, planar: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_planar`` (GGUF's interleaved block order)."""
    if qtype == INT8_ROW:
        return planar.contiguous()
    rows, sb = planar.shape[0], _scale_bytes(qtype)
    nb = planar.shape[1] // BLOCK_BYTES[qtype]
    qb = BLOCK_BYTES[qtype] - sb
    values = planar[:, : nb * qb].reshape(rows, nb, qb)
    scales = planar[:, nb * qb :].reshape(rows, sb // 2, nb, 2).transpose(1, 2)
    return torch.cat((scales.reshape(rows, nb, sb), values), dim=2).reshape(rows, -1).contiguous()


def dequantize(qtype: int, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """[rows, row_bytes] uint8, planar (+ [rows] fp32 scales for int8) -> [rows, cols] fp32."""
    rows = data.shape[0]
    if qtype == INT8_ROW:
        assert scales is not None
        return data.view(torch.int8).float() * scales.float()[:, None]
    blocks = to_blocks(qtype, data).reshape(rows, -1, BLOCK_BYTES[qtype])  # [rows, nb, bytes]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if qtype == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(rows, -1)
    if qtype == INT8_G32:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        return (d * blocks[..., 4:].float() + m).reshape(rows, -1)
    qs = blocks[..., 4:] if qtype == Q4_1 else blocks[..., 2:]
    nibbles = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [rows, nb, 32]: low nibbles first
    if qtype == Q4_0:
        return ((nibbles.to(torch.int8) - 8).float() * d).reshape(rows, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * nibbles.float() + m).reshape(rows, -1)


class QuantKernels:
    """The native linear over packed rows. Calls release the GIL; ``num_threads`` per call."""

    def __init__(self, lib_path: Path, num_threads: int) -> None:
        lib = ctypes.CDLL(str(lib_path))
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lin = lib.pdserve_quant_linear
        lin.argtypes = [i32, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, i32, i32]
        lin.restype = i32
        deq = lib.pdserve_dequant_rows
        deq.argtypes = [i32, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i32]
        deq.restype = i32
        f32 = ctypes.c_float
        lib.pdserve_rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32]
        lib.pdserve_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        lib.pdserve_swiglu.argtypes = [ptr, i64, i64, i64, ptr, i64]
        lib.pdserve_write_kv.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64]
        lib.pdserve_write_kv.argtypes += [i64, i32]
        lib.pdserve_quant_isa.restype = i32
        lib.pdserve_quant_set_isa.argtypes = [i32]
        lib.pdserve_quant_set_isa.restype = i32
        self._lib, self._linear, self._dequant = lib, lin, deq
        self.num_threads = max(1, num_threads)

    @property
    def lib(self) -> ctypes.CDLL:
        return self._lib

    @property
    def isa(self) -> str:
        return ISA_NAMES[self._lib.pdserve_quant_isa()]

    def set_isa(self, name: str | None) -> str:
        """Cap the instruction set (tests run every path this CPU has); None: the best."""
        level = -1 if name is None else ISA_NAMES.index(name)
        return ISA_NAMES[self._lib.pdserve_quant_set_isa(level)]

    def linear(
        self,
        qtype: int,
        data: torch.Tensor,  # [rows, row_bytes] uint8
        scales: torch.Tensor | None,  # [rows] fp32 (int8 only)
        cols: int,
        x: torch.Tensor,  # [n, cols] fp32, rows contiguous
        out: torch.Tensor,  # [n, rows] fp32, rows contiguous
        bias: torch.Tensor | None = None,  # [rows] fp32
        accumulate: bool = False,
    ) -> torch.Tensor:
        assert x.shape[1] == cols and out.shape[0] == x.shape[0] and out.shape[1] >= data.shape[0]
        rc = self._linear(
            qtype,
            data.data_ptr(),
            scales.data_ptr() if scales is not None else None,
            data.shape[0],
            cols,
            data.stride(0),
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            bias.data_ptr() if bias is not None else None,
            int(accumulate),
            self.num_threads,
        )
        if rc == -2:
            raise MemoryError("quant_linear: no memory for the activations' block sums")
        if rc != 0:
            raise ValueError(f"quant_linear: unsupported weight {QUANT_NAMES.get(qtype, qtype)}")
        return out

    def dequant(
        self,
        qtype: int,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        cols: int,
        out: torch.Tensor,  # [count, >= cols] fp32, rows contiguous
        row0: int = 0,
        row_ids: torch.Tensor | None = None,  # [count] int64, or rows row0 .. row0 + count
    ) -> torch.Tensor:
        count = row_ids.shape[0] if row_ids is not None else out.shape[0]
        rc = self._dequant(
            qtype,
            data.data_ptr(),
            scales.data_ptr() if scales is not None else None,
            data.shape[0],
            cols,
            data.stride(0),
            row_ids.data_ptr() if row_ids is not None else None,
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

    # -- the per-layer ops around the linears (fp32, rows contiguous) --------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) per row: [N, H] -> [N, H]."""
        out = torch.empty_like(x)
        n, h = x.shape
        self._lib.pdserve_rms_norm(
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            h,
            n,
            h,
            eps,
            self.num_threads,
        )
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
            qkv.data_ptr(),
            qkv.stride(0),
            qkv.shape[0],
            num_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
        )

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
            kv_cache.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            k.shape[0],
            slot_blocks.data_ptr(),
            slot_offsets.data_ptr(),
            num_layers,
            layer,
            block_size,
            hkv,
            head_dim,
            int(kv_cache.dtype == torch.uint8),
        )


def load_quant_kernels(cache_dir: Path, num_threads: int) -> QuantKernels | None:
    path = compile_kernel(_SOURCE, cache_dir, _FLAGS, _ALSO)
    if path is None:
        return None
    try:
        return QuantKernels(path, num_threads)
    except OSError as e:
        logger.warning("could not load the quantized linear kernel (%s); using torch", e)
        return None
