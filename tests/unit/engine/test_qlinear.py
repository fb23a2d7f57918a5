"""The integer kernels of ``model.numerics: fast`` (``kernels/qlinear.c``): every variant this
CPU has equals, bit for bit, a plain numpy implementation of the same arithmetic (activations
quantized to int8 with a scale per four inputs, exact int32 lane sums, the fixed fp32
accumulation order), whatever
the batch and the tile a row falls in; and the result stays close to the exact kernel."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cluster.engine.kernels.native import QLINEAR_ISA_NAMES, NativeKernels, load_native
from cluster.engine.kernels.quant import (
    BLOCK,
    FAST,
    INT8_G32,
    INT8_ROW,
    Q4_0,
    Q4_1,
    Q8_0,
    to_blocks,
)
from tests.unit.engine.test_quant_kernels import ALL_TYPES, packed

f32 = np.float32


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeKernels]:
    k = load_native(tmp_path_factory.mktemp("qlinear-cache"), 2)
    if k is None:
        pytest.skip("no C compiler: no integer kernels")
    yield k
    k.set_qlinear_isa(None)


def _variants(k: NativeKernels) -> list[str]:
    k.set_qlinear_isa(None)
    return list(QLINEAR_ISA_NAMES[: QLINEAR_ISA_NAMES.index(k.qlinear_isa) + 1])


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma: the product of two fp32 is exact in fp64, the sum rounds once there, then to
    fp32 (a second rounding that differs from fmaf only on exact fp32 ties: none here)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f32)


def _tree8(v: np.ndarray) -> np.ndarray:
    """((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) over the last axis, in fp32"""
    return ((v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])) + (
        (v[..., 4] + v[..., 5]) + (v[..., 6] + v[..., 7])
    )


def _weight_ints(qtype: int, data: torch.Tensor, cols: int) -> tuple[np.ndarray, ...]:
    """[rows, nb, 32] integers, [rows, nb] d and m (fp32 from fp16; ones / zeros where the
    type has none)"""
    rows, nb = data.shape[0], cols // BLOCK
    if qtype == INT8_ROW:
        q = data.view(torch.int8).numpy().astype(np.int64).reshape(rows, nb, BLOCK)
        return q, np.ones((rows, nb), f32), np.zeros((rows, nb), f32)
    blocks = to_blocks(qtype, data).numpy().reshape(rows, nb, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(f32)
    m = np.zeros((rows, nb), f32)
    if qtype in (Q4_1, INT8_G32):
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(f32)
    qs = blocks[..., 4:] if qtype in (Q4_1, INT8_G32) else blocks[..., 2:]
    if qtype == Q8_0:
        q = qs.view(np.int8).astype(np.int64)
    elif qtype == INT8_G32:
        q = qs.astype(np.int64)
    else:
        q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.int64)
        q = q - 8 if qtype == Q4_0 else q
    return q, d, m


def reference(qtype: int, data: torch.Tensor, scales: torch.Tensor | None, x: np.ndarray):
    """y [n, rows] by the arithmetic qlinear.c states at its top, in numpy."""
    n, cols = x.shape
    nb = cols // BLOCK
    xl = x.reshape(n, nb, 8, 4).astype(f32)  # [row, block, lane, input]
    d = (np.abs(xl).max(-1) / f32(127)).astype(f32)  # a scale per lane of four inputs
    inv = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(f32)
    q = np.clip(np.rint((xl * inv[..., None]).astype(f32)), -127, 127).astype(np.int64)
    xs = _tree8((d * q.sum(-1).astype(f32)).astype(f32))  # [row, block]
    w, dw, m = _weight_ints(qtype, data, cols)
    rows = w.shape[0]
    # p[r, i, b, l]: lane l's four products
    p = np.einsum("rblt,iblt->ribl", w.reshape(rows, nb, 8, 4), q)
    s = d[None] if qtype == INT8_ROW else (dw[:, None, :, None] * d[None]).astype(f32)
    s = np.broadcast_to(s, (rows, n, nb, 8))
    acc = np.zeros((rows, n, 2, 8), f32)
    for b in range(nb):
        acc[:, :, b % 2] = _fma(p[:, :, b].astype(f32), s[:, :, b], acc[:, :, b % 2])
    out = _tree8((acc[:, :, 0] + acc[:, :, 1]).astype(f32))
    if qtype in (Q4_1, INT8_G32):
        macc = np.zeros((rows, n, 8), f32)
        for b in range(nb):
            macc[..., b % 8] = _fma(m[:, None, b], xs[None, :, b], macc[..., b % 8])
        out = (out + _tree8(macc)).astype(f32)
    if qtype == INT8_ROW:
        assert scales is not None
        out = (out * scales.numpy()[:, None]).astype(f32)
    return out.T


def _x(n: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g)
    x[:, 3] *= 30  # an outlier: its block's scale differs from the others'
    x[0, :BLOCK] = 0  # a block of zeros (d = 0)
    return x


def _fast(k: NativeKernels, qtype: int, w, x: torch.Tensor, **kw) -> torch.Tensor:
    s = w.segments[0]
    out = torch.zeros(x.shape[0], s.rows)
    return k.linear(qtype | FAST, s.data, s.scales, x.shape[1], x, out, **kw)


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("cols", [160, 576])  # 5 blocks (an odd last one) and 18
def test_every_variant_equals_the_integer_reference_bit_for_bit(
    kernels: NativeKernels, qtype: int, cols: int
) -> None:
    w = packed(qtype, 37, cols, seed=qtype + cols)  # 37 rows: partial row tiles
    s = w.segments[0]
    # activation tiles of every size the variants specialise: 4 + 4 + 1, 4 + 2, 3
    for n in (9, 6, 3):
        x = _x(n, cols, seed=cols + n)
        want = reference(qtype, s.data, s.scales, x.numpy())
        for name in _variants(kernels):
            kernels.set_qlinear_isa(name)
            got = _fast(kernels, qtype, w, x).numpy()
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (
                name,
                n,
                np.abs(got - want).max(),
            )
    kernels.set_qlinear_isa(None)


@pytest.mark.parametrize("qtype", (Q4_1, Q8_0))
def test_a_rows_output_does_not_depend_on_its_batch(kernels: NativeKernels, qtype: int) -> None:
    w = packed(qtype, 64, 256, seed=3)
    x = _x(7, 256, seed=4)
    batch = _fast(kernels, qtype, w, x)
    for i in range(x.shape[0]):
        alone = _fast(kernels, qtype, w, x[i : i + 1].contiguous())
        assert torch.equal(alone[0], batch[i]), i


def test_bias_and_accumulate_are_applied_after_the_sum(kernels: NativeKernels) -> None:
    w = packed(Q4_0, 16, 128, seed=5)
    s = w.segments[0]
    x = _x(3, 128, seed=6)
    bias = torch.randn(16)
    plain = _fast(kernels, Q4_0, w, x)
    with_bias = _fast(kernels, Q4_0, w, x, bias=bias)
    assert torch.equal(with_bias, plain + bias)
    acc = torch.randn(3, 16)
    got = kernels.linear(Q4_0 | FAST, s.data, None, 128, x, acc.clone(), accumulate=True)
    assert torch.equal(got, acc + plain)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_fast_stays_close_to_the_exact_kernel(kernels: NativeKernels, qtype: int) -> None:
    w = packed(qtype, 48, 576, seed=7)
    s = w.segments[0]
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(8))
    exact = kernels.linear(qtype, s.data, s.scales, 576, x, torch.empty(4, 48))
    fast = _fast(kernels, qtype, w, x)
    rel = float((fast - exact).norm() / exact.norm())
    assert rel < 0.01, rel  # int8 activations: about 0.3-0.5% of the output's norm


def test_int8_rows_of_other_lengths_run_exact(kernels: NativeKernels) -> None:
    w = packed(INT8_ROW, 8, 72, seed=9)  # 72 columns: not whole blocks of 32
    s = w.segments[0]
    x = torch.randn(2, 72)
    exact = kernels.linear(INT8_ROW, s.data, s.scales, 72, x, torch.empty(2, 8))
    assert torch.equal(_fast(kernels, INT8_ROW, w, x), exact)
