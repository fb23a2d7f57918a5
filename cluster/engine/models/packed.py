"""Weights kept packed (quantized), and the linear function that runs on them and on dense ones.

A ``PackedWeight`` is a [rows, cols] matrix stored as one or more row segments (``PackedRows``),
each in one format (``kernels/quant.py``: Q4_0, Q4_1, Q8_0 blocks from a GGUF file, int8 groups
of 32 with an fp16 scale and minimum each, or int8 rows with fp32 scales). Fusing q/k/v (or
gate/up) concatenates rows; parts of different formats stay separate segments that write
adjacent output columns.

``PackedLinear`` is the model's ``linear``, over dense and packed weights alike. It has three
paths, and nothing else multiplies a weight:

    reference  torch: ``F.linear`` on the dense weight or on ``PackedWeight.dequantize()``.
               Any device and dtype; the path wherever the native library is absent.
    kernel     the native linear (``kernels/native.py``) for every format, F32 included, on a
               CPU fp32 model: weights stream once and are never expanded; a row's output does
               not depend on its batch. Up to ``kernel_max_rows`` activation rows. With
               ``fast`` (model.numerics) packed segments take the type id or'ed with ``FAST``:
               activations quantized to int8 (a scale per four inputs), integer dot products.
    tiles      more rows (prefill chunks): packed rows de-quantized into a reused fp32 scratch a
               tile at a time, then BLAS (``blas_linear``: oneDNN's linear where torch has it,
               else ``F.linear``) on each tile; a dense F32 weight is its own tile. Batching
               stays compute-bound.

The choice between kernel and tiles is ``kernel_max_rows`` (a rule by instruction set and
weights, from measurements; no timing at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine.kernels.native import NativeKernels
from cluster.engine.kernels.quant import (
    F32,
    FAST,
    QUANT_NAMES,
    PackedRows,
    dequantize,
    row_bytes,
    to_planar,
)

_SCRATCH_FLOATS = 1 << 21  # 8 MiB of fp32 tiles: a layer's largest matrix in one piece


@dataclass(eq=False, slots=True)
class PackedWeight:
    segments: tuple[PackedRows, ...]
    cols: int
    # Under model.numerics fast, multiply fp32 activations anyway: set on the attention's q/k/v
    # projection, whose inputs int8 moves the most (it flipped the default model's first token
    # on the README's question; load_model sets it).
    fp32_activations: bool = False

    @classmethod
    def of(
        cls, qtype: int, data: torch.Tensor, cols: int, scales: torch.Tensor | None = None
    ) -> PackedWeight:
        """From rows of interleaved blocks as GGUF stores them (held planar: ``to_planar``)."""
        if data.dim() != 2 or data.dtype != torch.uint8 or data.shape[1] != row_bytes(qtype, cols):
            raise ValueError(
                f"packed {QUANT_NAMES.get(qtype, qtype)} weight: {tuple(data.shape)} "
                f"{data.dtype} is not [rows, {row_bytes(qtype, cols)}] uint8 for {cols} columns"
            )
        return cls((PackedRows(qtype, to_planar(qtype, data), scales),), cols)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(QUANT_NAMES[s.qtype] for s in self.segments))

    @property
    def nbytes(self) -> int:
        return sum(
            s.data.numel() + (s.scales.numel() * 4 if s.scales is not None else 0)
            for s in self.segments
        )

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix [rows, cols] this stands for (the reference; tests, fallbacks)."""
        return torch.cat([dequantize(s.qtype, s.data, s.scales) for s in self.segments])

    def permute_rows(self, perm: torch.Tensor) -> PackedWeight:
        assert len(self.segments) == 1
        s = self.segments[0]
        scales = s.scales[perm].contiguous() if s.scales is not None else None
        return PackedWeight((PackedRows(s.qtype, s.data[perm].contiguous(), scales),), self.cols)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Rows of ``parts`` one after another; equal formats share one segment."""
        cols = parts[0].cols
        assert all(p.cols == cols for p in parts)
        merged: list[list[PackedRows]] = []
        for seg in (s for p in parts for s in p.segments):
            if merged and merged[-1][0].qtype == seg.qtype:
                merged[-1].append(seg)
            else:
                merged.append([seg])
        out = []
        for group in merged:
            if len(group) == 1:
                out.append(group[0])
                continue
            data = torch.cat([g.data for g in group])
            scales = [g.scales for g in group if g.scales is not None]
            out.append(PackedRows(group[0].qtype, data, torch.cat(scales) if scales else None))
        return PackedWeight(tuple(out), cols)


Weight = torch.Tensor | PackedWeight


def weight_format(weights: list[Weight], fast: bool = False) -> str:
    """``dense <dtype>`` or the packed formats in use, e.g. ``Q4_1 + Q8_0``; ``fast``: with
    ``, int8 activations (fast)`` where a packed (not F32) matrix is among them."""
    formats: dict[str, None] = {}
    for w in weights:
        if isinstance(w, PackedWeight):
            formats.update(dict.fromkeys(w.formats))
        else:
            formats[f"dense {str(w.dtype).removeprefix('torch.')}"] = None
    text = " + ".join(formats)
    return text + ", int8 activations (fast)" if fast and has_packed_rows(weights) else text


def has_packed_rows(weights: list[Weight]) -> bool:
    """Whether a segment of ``weights`` is quantized (not F32): what ``fast`` applies to."""
    return any(s.qtype != F32 for w in weights if isinstance(w, PackedWeight) for s in w.segments)


# The most activation rows the native kernel takes before tiles + BLAS win, by the instruction
# set its variants use and by the weights: dense (F32), packed, or packed with int8 activations
# (``fast``, model.numerics): a fixed rule, set below where the kernel stops being faster (the
# measurements: docs/design/decisions.md, "Linear paths by a rule"). The batch-invariant kernel
# takes every decode step of up to 32 rows, but packed weights on AVX-512, where oneDNN's tiles
# win beyond 16 rows. ``fast`` on AVX-512 takes every step: its integer kernel matched or beat
# the tiles at every row count measured up to 512 (so prefill chunks are batch-invariant too);
# on AVX2 it is no faster than the exact kernel (auto stays exact there: torch_runner).
KERNEL_MAX_ROWS = {
    "avx512": {"dense": 32, "packed": 16, "fast": 1 << 30},
    "avx2": {"dense": 32, "packed": 32, "fast": 32},
    "portable": {"dense": 4, "packed": 1, "fast": 1},
}


def kernel_max_rows(isa: str, packed: bool, fast: bool = False) -> int:
    """The rule between the kernel and tiles + BLAS (``KERNEL_MAX_ROWS``)."""
    return KERNEL_MAX_ROWS[isa][("fast" if fast else "packed") if packed else "dense"]


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _has_onednn_linear() -> bool:
    """Whether this torch build runs oneDNN's linear on fp32 CPU tensors, and equals
    ``F.linear`` on a small product (a capability check, not a timing)."""
    if not torch.backends.mkldnn.is_available():
        return False
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    try:
        out = _onednn_linear(x, w, b)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5))


_ONEDNN_LINEAR: bool | None = None


def blas_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The tiles' BLAS: oneDNN's linear (1.1-1.6x ``F.linear`` on the model's large matrices
    from 16 rows on, docs/design/decisions.md) where torch has it, else ``F.linear``."""
    global _ONEDNN_LINEAR
    if _ONEDNN_LINEAR is None:
        _ONEDNN_LINEAR = _has_onednn_linear()
    if _ONEDNN_LINEAR and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu":
        return _onednn_linear(x, w.contiguous(), b)
    return F.linear(x, w, b)


def reference_linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """The torch path: ``F.linear`` on the dense or de-quantized weight (any device, dtype)."""
    if isinstance(w, PackedWeight):
        w = w.dequantize().to(device=x.device, dtype=x.dtype)
    return F.linear(x, w, b)


class PackedLinear:
    """The linear function of a model, dense or packed (see the module docstring). ``fast``
    (model.numerics): the kernel path multiplies packed (not F32) segments with activations
    quantized to int8 (a scale per four inputs); the reference and tiles paths are unchanged."""

    def __init__(self, kernels: NativeKernels | None, fast: bool = False) -> None:
        self.kernels = kernels
        self.fast = fast
        self._scratch: torch.Tensor | None = None
        self._max_rows: int | None = None  # a test's override of the rule

    @property
    def kernel_max_rows(self) -> int:
        """Steps of up to this many rows run on the kernel with packed weights (the one-call
        decode step's limit too); 0 without the native library."""
        return self.max_rows(packed=True)

    @kernel_max_rows.setter
    def kernel_max_rows(self, rows: int | None) -> None:
        """Override the rule (tests put a step on one path or the other); None: the rule."""
        self._max_rows = rows

    def max_rows(self, packed: bool) -> int:
        """The rule for dense or packed weights on this library's instruction set."""
        if self.kernels is None:
            return 0
        if self._max_rows is not None:
            return self._max_rows
        return kernel_max_rows(self.kernels.isa, packed, self.fast)

    def native(self, x: torch.Tensor, w: Weight) -> bool:
        """Whether this call takes a native path (kernel or tiles): CPU fp32 throughout."""
        return (
            self.kernels is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and (isinstance(w, PackedWeight) or w.dtype == torch.float32)
        )

    def __call__(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
        if not self.native(x, w) or x.numel() == 0:
            return reference_linear(x, w, b)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # leading dims are rows
        if x2.shape[0] <= self.max_rows(isinstance(w, PackedWeight)):
            out = self._kernel(x2, w, b)
        else:
            out = self._tiled(x2, w, b)
        return out.view(*x.shape[:-1], out.shape[-1])

    def accumulate(self, h: torch.Tensor, x: torch.Tensor, w: Weight) -> bool:
        """h += x @ w.T inside the kernel (no temporary), when the kernel path applies."""
        packed = isinstance(w, PackedWeight)
        if not self.native(x, w) or x.shape[0] > self.max_rows(packed) or not h.is_contiguous():
            return False
        self._kernel(x.contiguous(), w, None, h)
        return True

    def _kernel(
        self, x: torch.Tensor, w: Weight, b: torch.Tensor | None, acc: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ w.T (+ b) on the native kernel, segment by segment; into ``acc`` (added) if given."""
        k = self.kernels
        assert k is not None
        cols, add = x.shape[1], acc is not None
        out = acc if acc is not None else torch.empty((x.shape[0], _rows(w)), dtype=torch.float32)
        if not isinstance(w, PackedWeight):
            return k.linear(F32, w.contiguous(), None, cols, x, out, b, add)
        fast = self.fast and not w.fp32_activations
        r0 = 0
        for s in w.segments:
            bias = b[r0 : r0 + s.rows] if b is not None else None
            qtype = s.qtype | FAST if fast and s.qtype != F32 else s.qtype
            k.linear(qtype, s.data, s.scales, cols, x, out[:, r0:], bias, add)
            r0 += s.rows
        return out

    def _tiled(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
        """De-quantize row tiles into the scratch and run ``blas_linear`` on each (a dense
        weight is its own tile)."""
        if not isinstance(w, PackedWeight):
            return blas_linear(x, w, b)
        tile_rows = max(1, _SCRATCH_FLOATS // w.cols)
        if self._scratch is None:
            self._scratch = torch.empty(_SCRATCH_FLOATS, dtype=torch.float32)
        if w.rows <= tile_rows:
            return blas_linear(x, self._dequant_rows(w, 0, w.rows), b)
        out = torch.empty((x.shape[0], w.rows), dtype=torch.float32)
        for r0 in range(0, w.rows, tile_rows):
            r1 = min(w.rows, r0 + tile_rows)
            bias = b[r0:r1] if b is not None else None
            out[:, r0:r1] = blas_linear(x, self._dequant_rows(w, r0, r1), bias)
        return out

    def _dequant_rows(self, w: PackedWeight, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of ``w`` as fp32, in the scratch (valid until the next call)."""
        assert self.kernels is not None and self._scratch is not None
        tile = self._scratch[: (r1 - r0) * w.cols].view(r1 - r0, w.cols)
        base = 0
        for s in w.segments:
            lo, hi = max(r0, base), min(r1, base + s.rows)
            if lo < hi:
                dst = tile[lo - r0 : hi - r0]
                if s.qtype == F32:
                    dst.copy_(dequantize(F32, s.data[lo - base : hi - base], None))
                else:
                    self.kernels.dequant(s.qtype, s.data, s.scales, w.cols, dst, row0=lo - base)
            base += s.rows
        return tile

    def embed(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of an embedding table: [N] -> [N, cols]."""
        if not isinstance(w, PackedWeight):
            return F.embedding(ids, w)
        s = w.segments[0]
        if (
            self.kernels is None
            or ids.device.type != "cpu"
            or len(w.segments) != 1
            or s.qtype == F32
        ):
            return F.embedding(ids, w.dequantize().to(ids.device))
        out = torch.empty((ids.shape[0], w.cols), dtype=torch.float32)
        return self.kernels.dequant(
            s.qtype, s.data, s.scales, w.cols, out, row_ids=ids.contiguous()
        )


def _rows(w: Weight) -> int:
    return w.rows if isinstance(w, PackedWeight) else int(w.shape[0])
