"""The native paged decode attention (one routine for fp32 and int8 KV) equals the torch gather
path on every instruction-set variant this CPU runs, and the engine agrees with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.attention import _decode_attention
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.kernels.native import ISA_NAMES, NativeKernels, load_native
from cluster.engine.kv_codec import FLOAT_KV, Int8KV
from cluster.engine.models.packed import PackedLinear
from tests.helpers import decode_only_meta, greedy, make_config, run_until_done


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeKernels]:
    k = load_native(tmp_path_factory.mktemp("cache"), 2)
    if k is None:
        pytest.skip("no native library (no C compiler): the engine uses the torch path")
    yield k
    k.set_isa(None)


def test_kernel_equals_torch_gather(native: NativeKernels) -> None:
    g = torch.Generator().manual_seed(0)
    nb, layers, bs, hkv, d, hq = 40, 3, 4, 2, 16, 6
    kv = torch.randn(nb, layers, 2, bs, hkv, d, generator=g)
    lens = torch.tensor([1, 5, 16, 23, 9], dtype=torch.long)
    width = 6
    perm = torch.randperm(nb, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), hq, d, generator=g)
    meta = decode_only_meta(tables, lens, bs, layers, hkv)
    for layer in range(layers):
        ref = _decode_attention(q, kv, layer, meta, 0.25)
        got = native.paged_decode(q, kv, tables, lens, layer, 0.25)
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(6, 2, 16), (9, 3, 64), (4, 4, 72), (8, 1, 12)])
def test_every_variant_equals_the_torch_path(
    native: NativeKernels, int8: bool, hq: int, hkv: int, d: int
) -> None:
    """Every variant this CPU runs (portable loops; AVX2 passes where head_dim % 8 == 0)
    against the torch gather path: contexts from 1 token to past two 32-token
    output chunks, tails of every length in the 8-token score tiles, head sizes with a part
    beyond 64 dimensions (72) and one the vector passes leave to the loops (12), and scores far
    apart (large q) so that most of a row's exponentials underflow to 0."""
    g = torch.Generator().manual_seed(hq * 100 + d)
    nb, layers, bs = 130, 2, 4
    lens = torch.tensor([1, 7, 8, 9, 33, 70, 64], dtype=torch.long)
    width = 18
    tables = torch.randperm(nb, generator=g)[: len(lens) * width].view(len(lens), width)
    tables = tables.contiguous()
    kv_f = torch.randn(nb, layers, 2, bs, hkv, d, generator=g)
    codec = Int8KV(d) if int8 else FLOAT_KV
    kv = codec.encode(kv_f) if int8 else kv_f
    q = torch.randn(len(lens), hq, d, generator=g)
    q[::2] *= 12.0  # every other request: peaked softmax rows
    meta = decode_only_meta(tables, lens, bs, layers, hkv)
    native.set_isa(None)
    outs = {}
    for isa in ISA_NAMES[: ISA_NAMES.index(native.isa) + 1]:
        native.set_isa(isa)
        outs[isa] = [native.paged_decode(q, kv, tables, lens, ly, d**-0.5) for ly in range(layers)]
    native.set_isa(None)
    for layer in range(layers):
        ref = _decode_attention(q, kv, layer, meta, d**-0.5, codec)
        for name in outs:
            torch.testing.assert_close(outs[name][layer], ref, atol=2e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.engine.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3", head_dim=24)


@pytest.mark.parametrize(
    ("family", "weights"), [("llama", "dense"), ("qwen3", "dense"), ("qwen3", "int8")]
)
def test_engine_backends_agree(request: pytest.FixtureRequest, family: str, weights: str) -> None:
    """Native and torch layer ops give the same tokens: for Qwen3 the q/k norms run before the
    native RoPE, and the one-call decode step (which has no q/k norm) stands aside."""
    model_dir = request.getfixturevalue("tiny_model_dir" if family == "llama" else "tiny_qwen3_dir")
    outs = {}
    for backend in ("native", "torch"):
        try:
            eng = LLMEngine(
                make_config(
                    **{
                        "model.path": str(model_dir),
                        "model.kernels": backend,
                        "model.weights": weights,
                        "model.numerics": "exact",  # the torch ops have no int8 activations
                        "model.num_threads": 2,
                        "cache.num_blocks": 256,
                    }
                )
            )
        except ValueError:
            pytest.skip("native backend unavailable here")
        for i in range(5):
            eng.add(EngineRequest(f"r{i}", [3 + i * 7 + j for j in range(5 + 11 * i)], greedy(20)))
        outs[backend] = run_until_done(eng)
        eng.check_integrity()
    assert outs["native"] == outs["torch"]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 33, 200])
def test_the_dense_linear_equals_f_linear_at_every_batch(native: NativeKernels, rows: int) -> None:
    """The model's linear on dense fp32 weights: the native kernel up to kernel_max_rows rows,
    BLAS beyond; both F.linear's values up to fp32 rounding."""
    linear = PackedLinear(native)
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g), None
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    x3 = x.view(1, rows, 96)  # leading batch dims count as rows
    torch.testing.assert_close(linear(x3, w, b), F.linear(x3, w, b), atol=1e-4, rtol=1e-4)
