"""The GPU path on a device (``pytest -m gpu tests/gpu/test_gpu_path.py``, in a process of its
own: tests/unit/gpu_path switches Triton's interpreter on for its process). The compiled Triton
kernels against an fp32 torch reference at real shapes, and captured decode steps
token-identical to eager ones. Skipped without a CUDA device (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cluster.engine.attention import AttentionMetadata, PrefillSeq
from cluster.engine.kv_codec import FloatKV, Int8KV, KVCodec

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("Triton's interpreter is on in this process", allow_module_level=True)
triton = pytest.importorskip("triton")

from cluster.engine.gpu.graphs import StepGraphs  # noqa: E402
from cluster.engine.gpu.triton_attention import (  # noqa: E402
    triton_paged_decode,
    triton_prefill_attention,
)

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def _cache(kind: str, dtype: torch.dtype, nb: int, bs: int, hkv: int, d: int):  # type: ignore[no-untyped-def]
    codec: KVCodec = Int8KV(d) if kind == "int8" else FloatKV(dtype)
    g = torch.Generator(device=CUDA).manual_seed(0)
    raw = torch.randn(nb, 2, 2, bs, hkv, d, device=CUDA, generator=g)
    stored = codec.encode(raw).contiguous()
    return stored, codec.decode(stored, torch.float32)


def _reference(q, kv, positions, scale):  # type: ignore[no-untyped-def]
    hq, hkv = q.shape[1], kv.shape[2]
    k = kv[:, 0].repeat_interleave(hq // hkv, dim=1)
    v = kv[:, 1].repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("nhd,thd->hnt", q.float(), k) * scale
    keys = torch.arange(kv.shape[0], device=q.device)
    s = s.masked_fill(keys[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(s, dim=-1), v)


def _seq_kv(values, table, layer, n):  # type: ignore[no-untyped-def]
    return values[table, layer].permute(0, 2, 1, 3, 4).flatten(0, 1)[:n]


@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize(("d", "bs"), [(64, 16), (80, 32), (128, 16)])
def test_decode_kernel_on_cuda(kind: str, d: int, bs: int) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16}[kind]
    b, hq, hkv, nb = 32, 9, 3, 4096
    stored, values = _cache(kind, dtype, nb, bs, hkv, d)
    lens = torch.randint(1, 2048, (b,), device=CUDA)
    width = 2048 // bs
    tables = torch.randperm(nb, device=CUDA)[: b * width].view(b, width).contiguous()
    q = torch.randn(b, hq, d, device=CUDA).to(dtype)
    got = triton_paged_decode(q, stored, tables, lens, 1, d**-0.5)
    for i in range(0, b, 7):
        n = int(lens[i])
        kv = _seq_kv(values, tables[i], 1, n)
        ref = _reference(q[i : i + 1], kv, torch.tensor([n - 1], device=CUDA), d**-0.5)
        torch.testing.assert_close(got[i : i + 1].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_prefill_kernel_on_cuda(kind: str) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}[kind]
    d, bs, hq, hkv, nb = 64, 16, 9, 3, 512
    stored, values = _cache(kind, dtype, nb, bs, hkv, d)
    n, ctx = 300, 1000
    table = torch.randperm(nb, device=CUDA)[: -(-(n + ctx) // bs)]
    q = torch.randn(n, hq, d, device=CUDA).to(dtype)
    got = triton_prefill_attention(q, stored, 0, PrefillSeq(0, n, ctx, table), 0.125)
    ref = _reference(
        q, _seq_kv(values, table, 0, n + ctx), torch.arange(n, device=CUDA) + ctx, 0.125
    )
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_captured_steps_equal_eager_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Greedy decoding of 3 rows (bucket 4) for 8 steps: captured graphs and eager steps pick
    the same tokens, and the graphs' logits equal the eager ones."""
    from cluster.engine.models.default_model import ModelSource
    from cluster.engine.models.weights import LoadSpec, load_model
    from tests.helpers import tiny_config

    config = tiny_config(tiny_model_dir, **{"model.kernels": "torch", "model.device": "cuda"})
    spec = LoadSpec(
        ModelSource(tiny_model_dir, None), torch.float32, CUDA, 256, False, tmp_path, False, "exact"
    )
    model = load_model(config, spec)
    a, bs, nb = model.arch, 16, 64
    kv0 = torch.randn(nb, a.num_layers, 2, bs, a.num_kv_heads, a.head_dim, device=CUDA)
    kvs = {"eager": kv0.clone(), "graph": kv0.clone()}

    def stepper(kv: torch.Tensor):  # type: ignore[no-untyped-def]
        return lambda ids, pos, meta: model.compute_logits(model.forward(ids, pos, meta, kv))

    graphs = StepGraphs(
        stepper(kvs["graph"]),
        triton_paged_decode,
        max_blocks=16,
        scratch_block=nb - 1,
        device=CUDA,
        buckets=(1, 2, 4, 8),
    )
    assert graphs.capture_all() < 60.0 and set(graphs.graphs) == {1, 2, 4, 8}
    tables = torch.arange(3 * 16, device=CUDA).view(3, 16)
    lens = torch.tensor([5, 17, 40], device=CUDA)
    tokens = {k: torch.tensor([1, 2, 3], device=CUDA) for k in kvs}
    for _ in range(8):
        pos = lens - 1
        meta = AttentionMetadata(
            slot_blocks=tables[torch.arange(3, device=CUDA), pos // bs],
            slot_offsets=pos % bs,
            num_decodes=3,
            decode_rows=None,
            decode_mask=None,
            prefills=[],
            decode_kernel=triton_paged_decode,
            decode_block_tables=tables,
            decode_ctx_lens=lens,
        )
        eager = stepper(kvs["eager"])(tokens["eager"], pos, meta)
        got = graphs.run(tokens["graph"], pos, meta)
        assert graphs.last_mode == "graph"
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
        tokens = {"eager": eager.argmax(-1), "graph": got.argmax(-1)}
        assert torch.equal(tokens["eager"], tokens["graph"])
        lens = lens + 1
