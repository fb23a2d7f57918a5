"""The weight formats of the native linear kernel, and their torch de-quantization.

Formats (one row of ``row_bytes`` bytes per output feature; ggml's type ids for the GGUF ones):

    F32 (0):   fp32 values (a dense fp32 matrix as it is: no packing)
    Q4_0 (2):  blocks of 32: fp16 d, 16 bytes of nibbles          w = d * (q - 8)
    Q4_1 (3):  blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m
    Q8_0 (8):  blocks of 32: fp16 d, 32 int8                      w = d * q
    int8 (1000, ours): int8 per value, one fp32 scale per row     w = s * q
    int8g32 (1001, ours): blocks of 32: fp16 d, fp16 m, 32 uint8  w = d * q + m

Block types are held *planar* in memory (``to_planar``): a row of nb blocks is its nb value
groups (16 or 32 bytes each), then its nb fp16 d, then (Q4_1, int8g32) its nb fp16 m. The same
bytes as GGUF's interleaved blocks, reordered so the kernels read sixteen blocks' scales in one
load; ``PackedWeight.of`` takes the interleaved blocks and reorders them once, at load time.

``dequantize`` (torch, any device) is the reference and the torch fallback; the native
kernel (``linear.c``, bound in ``native.py``) multiplies fp32 activations by the rows without
expanding them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F32, Q4_0, Q4_1, Q8_0, INT8_ROW, INT8_G32 = 0, 2, 3, 8, 1000, 1001
QUANT_NAMES = {
    F32: "F32",
    Q4_0: "Q4_0",
    Q4_1: "Q4_1",
    Q8_0: "Q8_0",
    INT8_ROW: "int8",
    INT8_G32: "int8g32",
}
# Or'ed into a packed type id (not F32): the native linear quantizes the activations to int8
# with a scale per four inputs and runs integer dot products (``model.numerics: fast``;
# linear.c / qlinear.c).
FAST = 0x10000
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, INT8_G32: 36}  # per 32 values
BLOCK = 32


@dataclass(frozen=True, eq=False, slots=True)
class PackedRows:
    """Rows of a weight matrix in one format: ``data`` [rows, row_bytes] uint8, planar
    (``to_planar``), or for F32 the [rows, cols] fp32 tensor itself; ``scales`` [rows] fp32
    for int8 rows only."""

    qtype: int
    data: torch.Tensor
    scales: torch.Tensor | None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


def row_bytes(qtype: int, cols: int) -> int:
    if qtype == F32:
        return cols * 4
    if qtype == INT8_ROW:
        return cols
    return cols // BLOCK * BLOCK_BYTES[qtype]


def _scale_bytes(qtype: int) -> int:
    """Bytes of a block's scales: fp16 d, and fp16 m where the type has a minimum."""
    return 4 if qtype in (Q4_1, INT8_G32) else 2


def to_planar(qtype: int, blocks: torch.Tensor) -> torch.Tensor:
    """[rows, row_bytes] interleaved blocks (GGUF's order: each block's scales, then its values)
    -> the same bytes planar: every block's values, then every d, then every m."""
    if qtype in (F32, INT8_ROW):
        return blocks.contiguous()
    rows, sb = blocks.shape[0], _scale_bytes(qtype)
    b = blocks.reshape(rows, -1, BLOCK_BYTES[qtype])
    parts = [b[..., sb:].reshape(rows, -1), b[..., 0:2].reshape(rows, -1)]
    if sb == 4:
        parts.append(b[..., 2:4].reshape(rows, -1))
    return torch.cat(parts, dim=1).contiguous()


def to_blocks(qtype: int, planar: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_planar`` (GGUF's interleaved block order)."""
    if qtype in (F32, INT8_ROW):
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
    if qtype == F32:
        return data.view(torch.float32) if data.dtype == torch.uint8 else data.float()
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
