"""The quantized-weight formats and the native kernels against torch references.

Every instruction-set path the host has runs (``set_isa`` caps the dispatch: portable, then
AVX2, then AVX-512 where the CPU has it), so a CI host with AVX-512 tests that path too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cluster.engine.kernels.native import ISA_NAMES, NativeKernels, load_native
from cluster.engine.kernels.quant import (
    INT8_G32,
    INT8_ROW,
    Q4_0,
    Q4_1,
    Q8_0,
    dequantize,
    to_blocks,
    to_planar,
)
from cluster.engine.kv_codec import Int8KV
from cluster.engine.models.int8 import quantize_int8_groups, quantize_int8_rows
from cluster.engine.models.packed import PackedLinear, PackedWeight, blas_linear

GGUF_TYPES = (Q4_0, Q4_1, Q8_0)
ALL_TYPES = (*GGUF_TYPES, INT8_ROW, INT8_G32)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeKernels]:
    k = load_native(tmp_path_factory.mktemp("quant-cache"), 2)
    if k is None:
        pytest.skip("no C compiler: packed weights use the torch fallback")
    yield k
    k.set_isa(None)


def _isas(k: NativeKernels) -> list[str]:
    k.set_isa(None)
    return list(ISA_NAMES[: ISA_NAMES.index(k.isa) + 1])


def packed(qtype: int, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    import gguf

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[:, :5] *= 20  # some outliers, so the blocks' scales differ
    if qtype == INT8_ROW:
        return quantize_int8_rows(w)
    if qtype == INT8_G32:
        return quantize_int8_groups(w)
    data = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(qtype))
    return PackedWeight.of(qtype, torch.from_numpy(np.ascontiguousarray(data)), cols)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_torch_dequantize_is_the_gguf_reference(qtype: int) -> None:
    import gguf

    w = packed(qtype, 24, 96)
    seg = w.segments[0]
    blocks = to_blocks(qtype, seg.data)  # GGUF's own interleaved bytes, held planar
    assert torch.equal(to_planar(qtype, blocks), seg.data)
    assert not torch.equal(blocks, seg.data)
    ref = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype))
    assert np.array_equal(dequantize(qtype, seg.data, None).numpy(), ref.reshape(24, 96))


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_native_dequant_equals_torch_on_every_isa(kernels: NativeKernels, qtype: int) -> None:
    w = packed(qtype, 37, 128, seed=1)
    seg = w.segments[0]
    ref = dequantize(qtype, seg.data, seg.scales)
    ids = torch.tensor([5, 0, 36, 5, 17])
    for isa in _isas(kernels):
        kernels.set_isa(isa)
        out = torch.empty(37, 128)
        assert torch.equal(kernels.dequant(qtype, seg.data, seg.scales, 128, out), ref), isa
        rows = torch.empty(5, 128)
        got = kernels.dequant(qtype, seg.data, seg.scales, 128, rows, row_ids=ids)
        assert torch.equal(got, ref[ids]), isa


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("n", [1, 3, 8, 19])
@pytest.mark.parametrize("cols", [192, 576])  # 6 and 18 blocks: a row's scales 8 at a time
def test_native_linear_matches_the_dequantized_reference(
    kernels: NativeKernels, qtype: int, n: int, cols: int
) -> None:
    rows = 70  # not a multiple of the 4-row groups or the thread split
    w = packed(qtype, rows, cols, seed=n)
    seg = w.segments[0]
    g = torch.Generator().manual_seed(100 + n)
    x = torch.randn(n, cols, generator=g)
    bias = torch.randn(rows, generator=g)
    base = torch.randn(n, rows, generator=g)
    ref = F.linear(x.double(), w.dequantize().double(), bias.double())
    tol = 1e-5 * float(ref.abs().max())
    for isa in _isas(kernels):
        kernels.set_isa(isa)
        out = torch.empty(n, rows)
        kernels.linear(qtype, seg.data, seg.scales, cols, x, out, bias)
        assert float((out.double() - ref).abs().max()) <= tol, isa
        acc = base.clone()
        kernels.linear(qtype, seg.data, seg.scales, cols, x, acc, bias, accumulate=True)
        assert float((acc.double() - (ref + base.double())).abs().max()) <= tol, isa


def test_the_thread_split_does_not_change_a_bit(tmp_path: Path) -> None:
    one = load_native(tmp_path, 1)
    two = load_native(tmp_path, 2)
    if one is None or two is None:
        pytest.skip("no C compiler")
    w = packed(Q4_1, 1000, 256).segments[0]
    for n in (1, 5):
        x = torch.randn(n, 256)
        a, b = torch.empty(n, 1000), torch.empty(n, 1000)
        one.linear(Q4_1, w.data, None, 256, x, a)
        two.linear(Q4_1, w.data, None, 256, x, b)
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_a_rows_output_does_not_depend_on_its_batch(kernels: NativeKernels, qtype: int) -> None:
    """Speculative verification runs k+1 rows of a request in one call; plain decode runs one.
    Each row must come out bit for bit as it would alone, on every ISA and batch size (the
    multi-row AVX-512 kernel groups 8, 4, 2 and 1 rows)."""
    rows, cols = 37, 320
    w = packed(qtype, rows, cols, seed=7).segments[0]
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(5))
    for isa in _isas(kernels):
        kernels.set_isa(isa)
        alone = torch.empty(19, rows)
        for i in range(19):
            kernels.linear(qtype, w.data, w.scales, cols, x[i : i + 1], alone[i : i + 1])
        for n in range(2, 20):
            out = torch.empty(n, rows)
            kernels.linear(qtype, w.data, w.scales, cols, x[:n], out)
            assert torch.equal(out, alone[:n]), (isa, n)


def test_packed_linear_mixed_segments_kernel_and_tiles(kernels: NativeKernels) -> None:
    parts = [packed(Q4_1, 24, 64, 1), packed(Q4_1, 8, 64, 2), packed(Q8_0, 8, 64, 3)]
    w = PackedWeight.cat(parts)
    assert [s.qtype for s in w.segments] == [Q4_1, Q8_0] and w.rows == 40
    dense = w.dequantize()
    assert torch.equal(dense, torch.cat([p.dequantize() for p in parts]))
    x, bias = torch.randn(6, 64), torch.randn(40)
    ref = F.linear(x, dense, bias)
    kernel = PackedLinear(kernels)
    kernel.kernel_max_rows = 64
    torch.testing.assert_close(kernel(x, w, bias), ref, atol=1e-5, rtol=1e-5)
    h = torch.randn(6, 40)
    h_acc = h.clone()
    assert kernel.accumulate(h_acc, x, w)
    torch.testing.assert_close(h_acc, h + F.linear(x, dense), atol=1e-5, rtol=1e-5)
    # Many rows: de-quantized tiles + the tiles' BLAS, on exactly the reference's weights.
    tiles = PackedLinear(kernels)
    tiles.kernel_max_rows = 0
    assert torch.equal(tiles(x, w, bias), blas_linear(x, dense, bias))
    torch.testing.assert_close(tiles(x, w, bias), ref, atol=1e-5, rtol=1e-5)
    big = packed(Q8_0, 40_000, 64, 4)  # more rows than one 8 MiB scratch tile holds
    assert torch.equal(tiles(x, big, None), blas_linear(x, big.dequantize(), None))
    # Embedding rows come out de-quantized exactly.
    ids = torch.tensor([3, 7, 0, 3])
    single = parts[2]
    assert torch.equal(kernel.embed(single, ids), single.dequantize()[ids])
    with pytest.raises(IndexError):
        kernel.embed(single, torch.tensor([8]))  # never a read outside the table


@pytest.mark.parametrize("int8", [False, True])
def test_native_kv_write_stores_the_codecs_bytes(kernels: NativeKernels, int8: bool) -> None:
    g = torch.Generator().manual_seed(3)
    nb, layers, bs, hkv, d = 6, 3, 4, 2, 16
    width = d + 4 if int8 else d
    dtype = torch.uint8 if int8 else torch.float32
    cache = torch.zeros(nb, layers, 2, bs, hkv, width, dtype=dtype)
    qkv = torch.randn(5, (4 + 2 * hkv) * d, generator=g)
    qkv[1, 4 * d : 4 * d + d] = 0.0  # an all-zero row: scale 0, values 0
    k = qkv[:, 4 * d : (4 + hkv) * d].view(5, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(5, hkv, d)
    blocks, offsets = torch.tensor([0, 5, 5, 2, 3]), torch.tensor([0, 1, 3, 2, 0])
    kernels.write_kv(cache, 1, k, v, blocks, offsets, d)
    encode = Int8KV(d).encode if int8 else (lambda x: x)
    assert torch.equal(cache[blocks, 1, 0, offsets], encode(k))
    assert torch.equal(cache[blocks, 1, 1, offsets], encode(v))
    cache[blocks, 1, :, offsets] = 0
    assert not cache.any()  # nothing written anywhere else


def test_int8_codec_round_trip_error_is_bounded() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    codec = Int8KV(64)
    rows = codec.encode(x)
    assert rows.shape == (50, 3, 68) and rows.dtype == torch.uint8
    back = codec.decode(rows, torch.float32)
    bound = x.abs().amax(-1, keepdim=True) / 127 / 2 * (1 + 1e-5)  # half a step per row
    assert bool(((back - x).abs() <= bound).all())
    assert torch.equal(codec.roundtrip(x), back)


def test_int8_groups_round_trip_within_half_a_step_of_each_group() -> None:
    """Each value comes back within half its group's step (d / 2, plus fp16's rounding of m),
    groups with an outlier do not coarsen the others, and a constant group is exact."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 96, generator=g) * 0.05
    w[:, 0] = 4.0  # an outlier in the first group of every row
    w[:, 64:] = -0.25  # a constant group
    p = quantize_int8_groups(w)
    assert p.formats == ("int8g32",) and p.nbytes == 8 * 3 * 36
    back = p.dequantize()
    groups = w.reshape(8, 3, 32)
    step = (groups.amax(dim=2) - groups.amin(dim=2)) / 255  # [8, 3]
    err = (back - w).abs().reshape(8, 3, 32).amax(dim=2)
    assert bool((err <= step * 0.5 * 1.01 + 1e-3 * step.clamp_min(1e-4)).all()), (err, step)
    assert float(err[:, 1].max()) < 1e-3  # the outlier's group only
    assert torch.equal(back[:, 64:], w[:, 64:])
    rows = quantize_int8_rows(w).dequantize()
    assert float((rows - w)[:, 32:64].abs().max()) > 10 * float(err[:, 1].max())


def test_int8_groups_fall_back_to_rows_where_columns_are_not_whole_groups() -> None:
    w = torch.randn(4, 40)
    assert quantize_int8_groups(w).formats == ("int8",)
