"""Weights kept packed (quantized), and the linear function that runs on them.

A ``PackedWeight`` is a [rows, cols] matrix stored as one or more row segments, each in one
format (``kernels/quant.py``: Q4_0, Q4_1, Q8_0 blocks from a GGUF file, int8 groups of 32 with
an fp16 scale and minimum each, or int8 rows with fp32 scales). Fusing q/k/v (or gate/up)
concatenates rows; parts of different formats stay separate segments that write adjacent
output columns.

``PackedLinear`` is the model's ``linear``: dense weights go to the dense linear as before;
packed weights, on a CPU fp32 model with the native kernel, go

    rows of x <= kernel_max_rows:  the native kernel (weights stream once, never expanded)
    more rows:                     de-quantized tiles in a reused fp32 scratch, then the dense
                                   linear (BLAS) on each tile: batching stays compute-bound

(``probe_kernel_max_rows`` measures where the kernel stops winning on this CPU at start-up).
Without the kernel (no compiler, another device or dtype) packed weights are de-quantized in
torch per call: correct everywhere, fast nowhere.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine.kernels.quant import (
    Q4_1,
    QUANT_NAMES,
    QuantKernels,
    dequantize,
    row_bytes,
    to_planar,
)

logger = logging.getLogger(__name__)

DenseLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
_SCRATCH_FLOATS = 1 << 21  # 8 MiB of fp32 tiles: a layer's largest matrix in one piece


@dataclass(eq=False, slots=True)
class Segment:
    qtype: int
    data: torch.Tensor  # [rows, row_bytes] uint8
    scales: torch.Tensor | None  # [rows] fp32 (int8 rows only)

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


@dataclass(eq=False, slots=True)
class PackedWeight:
    segments: tuple[Segment, ...]
    cols: int

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
        return cls((Segment(qtype, to_planar(qtype, data), scales),), cols)

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
        return PackedWeight((Segment(s.qtype, s.data[perm].contiguous(), scales),), self.cols)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Rows of ``parts`` one after another; equal formats share one segment."""
        cols = parts[0].cols
        assert all(p.cols == cols for p in parts)
        merged: list[list[Segment]] = []
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
            out.append(Segment(group[0].qtype, data, torch.cat(scales) if scales else None))
        return PackedWeight(tuple(out), cols)


Weight = torch.Tensor | PackedWeight


def weight_format(weights: list[Weight]) -> str:
    """``dense <dtype>`` or the packed formats in use, e.g. ``Q4_1 + Q8_0``."""
    formats: dict[str, None] = {}
    for w in weights:
        if isinstance(w, PackedWeight):
            formats.update(dict.fromkeys(w.formats))
        else:
            formats[f"dense {str(w.dtype).removeprefix('torch.')}"] = None
    return " + ".join(formats)


class PackedLinear:
    """The linear function of a model whose weights may be packed (see the module docstring)."""

    def __init__(
        self,
        dense: DenseLinear,
        kernels: QuantKernels | None,
        kernel_max_rows: int = 0,
    ) -> None:
        self.dense = dense
        self.kernels = kernels
        self.kernel_max_rows = kernel_max_rows
        self._scratch: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(w, PackedWeight):
            return self.dense(x, w, b)
        k = self.kernels
        if k is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return self.dense(x, w.dequantize().to(device=x.device, dtype=x.dtype), b)
        x = x.contiguous()
        n = x.shape[0]
        if n <= self.kernel_max_rows:
            out = torch.empty((n, w.rows), dtype=torch.float32)
            r0 = 0
            for s in w.segments:
                bias = b[r0 : r0 + s.rows] if b is not None else None
                k.linear(s.qtype, s.data, s.scales, w.cols, x, out[:, r0:], bias)
                r0 += s.rows
            return out
        return self._tiled(x, w, b)

    def accumulate(self, h: torch.Tensor, x: torch.Tensor, w: PackedWeight) -> bool:
        """h += x @ w.T inside the kernel (no temporary), when the kernel path applies."""
        k = self.kernels
        n = x.shape[0]
        if (
            k is None
            or n > self.kernel_max_rows
            or not h.is_contiguous()
            or x.dtype != torch.float32
        ):
            return False
        x = x.contiguous()
        r0 = 0
        for s in w.segments:
            k.linear(s.qtype, s.data, s.scales, w.cols, x, h[:, r0:], None, accumulate=True)
            r0 += s.rows
        return True

    def _tiled(self, x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None) -> torch.Tensor:
        """De-quantize row tiles into the scratch and run the dense linear on each."""
        assert self.kernels is not None
        tile_rows = max(1, _SCRATCH_FLOATS // w.cols)
        if self._scratch is None:
            self._scratch = torch.empty(_SCRATCH_FLOATS, dtype=torch.float32)
        if w.rows <= tile_rows:
            tile = self._dequant_rows(w, 0, w.rows)
            return self.dense(x, tile, b)
        out = torch.empty((x.shape[0], w.rows), dtype=torch.float32)
        for r0 in range(0, w.rows, tile_rows):
            r1 = min(w.rows, r0 + tile_rows)
            bias = b[r0:r1] if b is not None else None
            out[:, r0:r1] = self.dense(x, self._dequant_rows(w, r0, r1), bias)
        return out

    def _dequant_rows(self, w: PackedWeight, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of ``w`` as fp32, in the scratch (valid until the next call)."""
        assert self.kernels is not None and self._scratch is not None
        tile = self._scratch[: (r1 - r0) * w.cols].view(r1 - r0, w.cols)
        base = 0
        for s in w.segments:
            lo, hi = max(r0, base), min(r1, base + s.rows)
            if lo < hi:
                self.kernels.dequant(
                    s.qtype, s.data, s.scales, w.cols, tile[lo - r0 : hi - r0], row0=lo - base
                )
            base += s.rows
        return tile

    def embed(self, w: Weight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of an embedding table: [N] -> [N, cols]."""
        if not isinstance(w, PackedWeight):
            return F.embedding(ids, w)
        if self.kernels is None or ids.device.type != "cpu" or len(w.segments) != 1:
            return F.embedding(ids, w.dequantize().to(ids.device))
        s = w.segments[0]
        out = torch.empty((ids.shape[0], w.cols), dtype=torch.float32)
        ids = ids.contiguous()
        return self.kernels.dequant(s.qtype, s.data, s.scales, w.cols, out, row_ids=ids)


_PROBED: dict[tuple[int, DenseLinear], int] = {}
# How much slower than tiles the kernel may be on the probe's matrices and still keep a row
# count: the probe does not see all that the kernel path saves in a step (decode steps of up to
# kernel_max_rows rows run every layer in one native call, no scratch is written and re-read).
KERNEL_MARGIN = 1.15
_PROBE_POOL_BYTES = 48 << 20  # more than a server CPU's last-level cache slice


def probe_kernel_max_rows(kernels: QuantKernels, dense: DenseLinear) -> int:
    """Measured once per (thread count, dense linear) in a process: see ``_probe``."""
    key = (kernels.num_threads, dense)
    if key not in _PROBED:
        _PROBED[key] = _probe(kernels, dense)
    return _PROBED[key]


def _probe(kernels: QuantKernels, dense: DenseLinear) -> int:
    """The most activation rows at which the native kernel still beats de-quantize + BLAS.

    Timed on random Q4_1 [1536, 576] matrices (an MLP projection of the default model) at
    1, 2, 4, 8, 16, 32 rows, interleaved (each first in turn), median of 9 rounds; the kernel
    keeps every row count up to the first it loses by ``KERNEL_MARGIN`` (it always keeps 1:
    there it never expands the weights). Each call takes the next of ``_PROBE_POOL_BYTES`` of
    copies, so the weights come from memory as a model's do in a step. Timed on one matrix held
    in cache, the probe chose tiles at 32 rows in some runs on a 2-core AVX2 EPYC, where a bs32
    decode step of the default model then took 211-229 ms against 128-141 ms on the kernel path.
    """
    g = torch.Generator().manual_seed(0)
    rows, cols = 1536, 576
    data = torch.randint(0, 256, (rows, row_bytes(Q4_1, cols)), dtype=torch.uint8, generator=g)
    blocks = data.view(rows, -1, 20)
    blocks[..., 0:2] = torch.tensor([0x66, 0x20], dtype=torch.uint8)  # d ~ 0.008 (fp16)
    blocks[..., 2:4] = torch.tensor([0x66, 0xA0], dtype=torch.uint8)  # m ~ -0.008
    one = PackedWeight.of(Q4_1, data, cols).segments[0].data
    copies = max(2, _PROBE_POOL_BYTES // one.numel())
    pool = one.repeat(copies, 1)  # distinct memory, the same values
    weights = [
        PackedWeight((Segment(Q4_1, pool[i * rows : (i + 1) * rows], None),), cols)
        for i in range(copies)
    ]
    turn = itertools.count()

    def call(f: PackedLinear, x: torch.Tensor) -> None:
        f(x, weights[next(turn) % copies], None)

    kernel = PackedLinear(dense, kernels, kernel_max_rows=1 << 30)
    tiled = PackedLinear(dense, kernels, kernel_max_rows=0)
    best = 1
    for n in (2, 4, 8, 16, 32):
        x = torch.randn(n, cols, generator=g)
        ratios = []
        for r in range(9):
            times = {}
            for f in (kernel, tiled) if r % 2 else (tiled, kernel):  # either goes first
                call(f, x)  # warm
                t0 = time.perf_counter()
                for _ in range(3):
                    call(f, x)
                times[f] = time.perf_counter() - t0
            ratios.append(times[kernel] / times[tiled])
        ratios.sort()
        if ratios[len(ratios) // 2] >= KERNEL_MARGIN:
            break
        best = n
    logger.info("packed linear: native kernel up to %d rows, then de-quantized tiles + BLAS", best)
    return best
