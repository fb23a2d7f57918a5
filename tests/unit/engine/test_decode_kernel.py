"""The native paged decode kernel equals the torch gather path, and the engine agrees with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.engine.attention import AttentionMetadata, _decode_attention, decode_row_index
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels import load_paged_decode
from tests.helpers import greedy, make_config, run_until_done


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    k = load_paged_decode(tmp_path_factory.mktemp("cache"), 2, num_heads=6, num_kv_heads=2)
    if k is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    return k


def test_kernel_equals_torch_gather(kernel) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    nb, layers, bs, hkv, d, hq = 40, 3, 4, 2, 16, 6
    kv = torch.randn(nb, layers, 2, bs, hkv, d, generator=g)
    lens = torch.tensor([1, 5, 16, 23, 9], dtype=torch.long)
    width = 6
    perm = torch.randperm(nb, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), hq, d, generator=g)
    rows = decode_row_index(tables, bs, layers, hkv)
    mask = torch.zeros(len(lens), width * bs)
    mask.masked_fill_(torch.arange(width * bs)[None, :] >= lens[:, None], float("-inf"))
    meta = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_rows=rows,
        decode_mask=mask,
        prefills=[],
    )
    for layer in range(layers):
        ref = _decode_attention(q, kv, layer, meta, 0.25)
        got = kernel(q, kv, tables, lens, layer, 0.25)
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_engine_backends_agree(tiny_model_dir: Path) -> None:
    outs = {}
    for backend in ("native", "torch"):
        try:
            eng = LLMEngine(
                make_config(
                    **{
                        "model.path": str(tiny_model_dir),
                        "model.kernels": backend,
                        "model.num_threads": 2,
                        "cache.num_blocks": 256,
                    }
                )
            )
        except ValueError:
            pytest.skip("native backend unavailable here")
        for i in range(5):
            eng.add(f"r{i}", [3 + i * 7 + j for j in range(5 + 11 * i)], greedy(20))
        outs[backend] = run_until_done(eng)
        eng.check_integrity()
    assert outs["native"] == outs["torch"]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32, 200])
def test_the_chosen_linear_equals_f_linear_at_every_batch(rows: int) -> None:
    import torch.nn.functional as F

    from cluster.engine.models.llama import onednn_linear

    linear = onednn_linear()  # oneDNN, a per-batch mix, or None (F.linear), by this machine
    if linear is None:
        pytest.skip("oneDNN is missing or never faster here: the engine uses F.linear")
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g), None
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    x3 = x.view(1, rows, 96)  # leading batch dims count as rows
    torch.testing.assert_close(linear(x3, w, b), F.linear(x3, w, b), atol=1e-4, rtol=1e-4)
