"""The Triton paged attention kernels equal an fp32 torch reference under Triton's interpreter.

Each case fills a small cache with random values stored in the cache dtype (int8 through the
int8 codec), scatters each sequence's context over random, non-contiguous blocks, and compares
the kernel with attention over the same de-quantized values computed in fp32. Tolerances are
the output dtype's rounding: fp32 1e-5, fp16 2e-3, bf16 2e-2 (int8 KV with fp32 queries: 1e-5,
as the values are de-quantized exactly). Head sizes 64, 80 (not a power of two) and 128, block
sizes 16 and 32, contexts that end inside, on, and past block boundaries, GQA groups 1 and 3.
"""

from __future__ import annotations

import pytest
import torch

from cluster.engine.attention import PrefillSeq, _decode_attention, _prefill_attention
from cluster.engine.kv_codec import FloatKV, Int8KV, KVCodec
from tests.helpers import decode_only_meta

triton = pytest.importorskip("triton")

from cluster.engine.gpu.triton_attention import (  # noqa: E402 (after the importorskip)
    PrefillBatch,
    triton_paged_decode,
    triton_prefill_attention,
    triton_prefill_batch,
)

pytestmark = pytest.mark.timeout(120)

LAYERS = 2
NUM_BLOCKS = 24
# (q dtype, KV dtype name) -> (atol, rtol)
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = {
    "fp32": (torch.float32, "float"),
    "fp16": (torch.float16, "float"),
    "bf16": (torch.bfloat16, "float"),
    "int8": (torch.float32, "int8"),
    "int8-bf16": (torch.bfloat16, "int8"),
}
# (head_dim, block_size, q heads, kv heads): every head size with both block sizes and groups
SHAPES = [(64, 16, 3, 1), (80, 32, 2, 2), (128, 16, 2, 2), (80, 16, 6, 2), (64, 32, 2, 2)]


def _codec(kind: str, dtype: torch.dtype, d: int) -> KVCodec:
    return Int8KV(d) if kind == "int8" else FloatKV(dtype)


def _cache(
    g: torch.Generator, codec: KVCodec, bs: int, hkv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache as stored, the same values de-quantized to fp32)."""
    raw = torch.randn(NUM_BLOCKS, LAYERS, 2, bs, hkv, d, generator=g)
    stored = codec.encode(raw).contiguous()
    return stored, codec.decode(stored, torch.float32)


def _tables(g: torch.Generator, lens: list[int], bs: int) -> torch.Tensor:
    width = max(-(-n // bs) for n in lens) + 1  # one spare column: tables are padded
    perm = torch.randperm(NUM_BLOCKS, generator=g)[: len(lens) * width]
    return perm.view(len(lens), width).contiguous()


def _keys(values: torch.Tensor, table: torch.Tensor, layer: int, n: int) -> torch.Tensor:
    """[n, 2, Hkv, D] fp32: the first n tokens' K and V of one sequence."""
    rows = values[table, layer].permute(0, 2, 1, 3, 4).flatten(0, 1)  # [blocks * bs, 2, Hkv, D]
    return rows[:n]


def _attend(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp32 reference: q [n, Hq, D] at ``positions`` over kv [T, 2, Hkv, D] -> [n, Hq, D]."""
    hq, hkv = q.shape[1], kv.shape[2]
    k = kv[:, 0].repeat_interleave(hq // hkv, dim=1)  # [T, Hq, D]
    v = kv[:, 1].repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("nhd,thd->hnt", q.float(), k) * scale
    keys = torch.arange(kv.shape[0])
    s = s.masked_fill(keys[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize(("d", "bs", "hq", "hkv"), SHAPES)
def test_decode_equals_reference(kind: str, d: int, bs: int, hq: int, hkv: int) -> None:
    dtype, kv_kind = DTYPES[kind]
    g = torch.Generator().manual_seed(d * 7 + bs + hq)
    codec = _codec(kv_kind, dtype, d)
    stored, values = _cache(g, codec, bs, hkv, d)
    lens = [1, bs - 1, bs, bs + 1, 2 * bs + 5]  # inside, on and past block boundaries
    tables = _tables(g, lens, bs)
    ctx = torch.tensor(lens, dtype=torch.long)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    layer, scale = 1, d**-0.5
    got = triton_paged_decode(q, stored, tables, ctx, layer, scale)
    assert got.dtype == dtype and got.shape == q.shape
    for i, n in enumerate(lens):
        ref = _attend(
            q[i : i + 1], _keys(values, tables[i], layer, n), torch.tensor([n - 1]), scale
        )
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got[i : i + 1].float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_decode_equals_the_torch_path(kind: str) -> None:
    """The kernel is a drop-in ``AttentionMetadata.decode_kernel``: it equals attention.py's own
    gather path on the same inputs."""
    d, bs, hq, hkv = 80, 16, 4, 2
    dtype, kv_kind = DTYPES[kind]
    g = torch.Generator().manual_seed(3)
    codec = _codec(kv_kind, dtype, d)
    stored, _ = _cache(g, codec, bs, hkv, d)
    lens = torch.tensor([3, 17, 40], dtype=torch.long)
    tables = _tables(g, lens.tolist(), bs)
    q = torch.randn(3, hq, d, generator=g)
    meta = decode_only_meta(tables, lens, bs, LAYERS, hkv)
    for layer in range(LAYERS):
        ref = _decode_attention(q, stored, layer, meta, 0.1, codec)
        got = triton_paged_decode(q, stored, tables, lens, layer, 0.1)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# (chunk length, tokens before it): no prefix, a prefix hit ending on a block boundary, and a
# later chunk ending mid-block; chunks longer than one 16-query tile
CHUNKS = [(5, 0), (20, 16), (7, 37)]


@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize(("d", "bs", "hq", "hkv"), SHAPES)
def test_prefill_equals_reference(kind: str, d: int, bs: int, hq: int, hkv: int) -> None:
    dtype, kv_kind = DTYPES[kind]
    g = torch.Generator().manual_seed(d * 5 + bs + hq)
    codec = _codec(kv_kind, dtype, d)
    stored, values = _cache(g, codec, bs, hkv, d)
    tables = _tables(g, [n + c for n, c in CHUNKS], bs)
    total = sum(n for n, _ in CHUNKS)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    seqs, row = [], 0
    for i, (n, c) in enumerate(CHUNKS):
        seqs.append(PrefillSeq(row, n, c, tables[i, : -(-(n + c) // bs)]))
        row += n
    layer, scale = 0, d**-0.5
    out = triton_prefill_batch(q, stored, layer, PrefillBatch.of(seqs, q.device), scale)
    atol, rtol = TOL[dtype]
    for i, p in enumerate(seqs):
        rows = slice(p.start, p.start + p.num_tokens)
        positions = torch.arange(p.num_tokens) + p.num_context
        kv = _keys(values, tables[i], layer, p.num_context + p.num_tokens)
        ref = _attend(q[rows], kv, positions, scale)
        torch.testing.assert_close(out[rows].float(), ref, atol=atol, rtol=rtol)
        one = triton_prefill_attention(q[rows], stored, layer, p, scale)
        torch.testing.assert_close(one, out[rows], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_prefill_equals_the_torch_path(kind: str) -> None:
    """The single-chunk wrapper equals attention.py's SDPA path (whose chunk reads its own KV
    round-tripped, the cache for its context) on a prefix hit and on a first chunk."""
    d, bs, hq, hkv = 64, 16, 4, 2
    dtype, kv_kind = DTYPES[kind]
    g = torch.Generator().manual_seed(11)
    codec = _codec(kv_kind, dtype, d)
    stored, _ = _cache(g, codec, bs, hkv, d)
    for n, c in [(9, 0), (12, 21)]:
        table = _tables(g, [n + c], bs)[0, : -(-(n + c) // bs)]
        p = PrefillSeq(0, n, c, table)
        q = torch.randn(n, hq, d, generator=g)
        layer = 1
        k_cache, v_cache = stored[:, layer, 0], stored[:, layer, 1]
        own = _keys(codec.decode(stored, dtype), table, layer, n + c)[c:]  # the chunk's own KV
        ref = _prefill_attention(q, own[:, 0], own[:, 1], k_cache, v_cache, p, 0.125, codec)
        got = triton_prefill_attention(q, stored, layer, p, 0.125)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_kernels_read_a_head_range_view(kind: str) -> None:
    """A tensor-parallel rank's view of its KV heads (``kv_cache[..., h0:h1, :]``, not
    contiguous) is read through its strides: the same as the whole cache's heads h0..h1."""
    d, bs, hkv, group = 64, 16, 4, 2
    dtype, kv_kind = DTYPES[kind]
    g = torch.Generator().manual_seed(5)
    stored, _ = _cache(g, _codec(kv_kind, dtype, d), bs, hkv, d)
    lens = [7, 30]
    tables = _tables(g, lens, bs)
    ctx = torch.tensor(lens, dtype=torch.long)
    q = torch.randn(2, hkv * group, d, generator=g)
    whole = triton_paged_decode(q, stored, tables, ctx, 1, 0.1)
    view = stored[:, :, :, :, 1:3]
    part = triton_paged_decode(q[:, 2:6].contiguous(), view, tables, ctx, 1, 0.1)
    torch.testing.assert_close(part, whole[:, 2:6], atol=0, rtol=0)
    p = PrefillSeq(0, 20, 12, tables[1, :2])
    qp = torch.randn(20, hkv * group, d, generator=g)
    whole_p = triton_prefill_attention(qp, stored, 0, p, 0.1)
    part_p = triton_prefill_attention(qp[:, 2:6].contiguous(), view, 0, p, 0.1)
    torch.testing.assert_close(part_p, whole_p[:, 2:6], atol=0, rtol=0)
