"""int8 weight-only quantization of dense matrices into ``PackedWeight`` (``model.weights``:
``int8`` in groups of 32, ``int8_rows`` one scale per output channel; ``kernels/quant.py`` has
the formats and the native kernels that run them)."""

from __future__ import annotations

import torch

from cluster.engine.kernels.quant import BLOCK, INT8_G32, INT8_ROW
from cluster.engine.models.packed import PackedWeight


def quantize_int8_rows(w: torch.Tensor) -> PackedWeight:
    """Per-output-channel int8: s = max|w[r]| / 127, q = round(w / s) (weight-only)."""
    wf = w.detach().float()
    scales = wf.abs().amax(dim=1) / 127.0  # [rows]
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(wf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return PackedWeight.of(INT8_ROW, q.view(torch.uint8), w.shape[1], scales.contiguous())


def quantize_int8_groups(w: torch.Tensor) -> PackedWeight:
    """Asymmetric int8 over groups of 32 inputs (weight-only): per group, m = min (fp16),
    d = (max - m) / 255 (fp16), q = round((w - m) / d) in 0..255, so w ~ d * q + m.

    Finer than one scale per row (a row's outliers no longer coarsen all of it), and the zero
    point spends all 256 levels on the group's own range. Falls back to ``quantize_int8_rows``
    where the columns are not whole groups or fp16 cannot hold the group's d and m."""
    rows, cols = w.shape
    if cols % BLOCK:
        return quantize_int8_rows(w)
    g = w.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    lo = g.amin(dim=2, keepdim=True)
    hi = g.amax(dim=2, keepdim=True)
    m = lo.half()
    d = ((hi - m.float()) / 255.0).half()
    if not (torch.isfinite(m).all() and torch.isfinite(d).all()):
        return quantize_int8_rows(w)
    df, mf = d.float(), m.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round((g - mf) * inv).clamp_(0, 255).to(torch.uint8)
    blocks = torch.cat((d.view(torch.uint8), m.view(torch.uint8), q), dim=2)  # 2 + 2 + 32 bytes
    return PackedWeight.of(INT8_G32, blocks.reshape(rows, -1), cols)
