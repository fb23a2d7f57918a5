"""The one native library: every instruction-set variant this CPU runs equals the torch
reference, and the library is built, found, refused and missed as ``kernels/build.py`` and
``kernels/library.py`` say (a missing compiler falls back to torch with the reason logged)."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.attention import _decode_attention
from cluster.engine.kernels import build, library
from cluster.engine.kernels.native import _SIGNATURES, ISA_NAMES, NativeKernels, load_native
from cluster.engine.kernels.quant import F32, INT8_G32, INT8_ROW, Q4_0, Q4_1, Q8_0, dequantize
from cluster.engine.kv_codec import FLOAT_KV, Int8KV
from cluster.engine.models.layer_ops import apply_rope, rms_norm
from tests.helpers import decode_only_meta
from tests.unit.engine.test_quant_kernels import packed


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeKernels]:
    k = load_native(tmp_path_factory.mktemp("native-cache"), 2)
    if k is None:
        pytest.skip("no native library here (no C compiler): the engine runs torch")
    yield k
    k.set_isa(None)


def _use(kernels: NativeKernels, isa: str) -> None:
    """Cap the library at ``isa``; skip where this CPU lacks it."""
    kernels.set_isa(None)
    best = kernels.isa
    if ISA_NAMES.index(isa) > ISA_NAMES.index(best):
        pytest.skip(f"this CPU lacks {isa} (its best is {best})")
    assert kernels.set_isa(isa) == isa


# -- every variant against the torch reference -------------------------------------------------


@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize("qtype", [F32, Q4_0, Q4_1, Q8_0, INT8_ROW, INT8_G32])
def test_linear_and_dequant_equal_torch(kernels: NativeKernels, isa: str, qtype: int) -> None:
    _use(kernels, isa)
    rows, cols, n = 45, 320, 11
    g = torch.Generator().manual_seed(qtype)
    if qtype == F32:
        data, scales = torch.randn(rows, cols, generator=g), None
        dense = data
    else:
        seg = packed(qtype, rows, cols, seed=qtype).segments[0]
        data, scales = seg.data, seg.scales
        dense = dequantize(qtype, data, scales)
        out = kernels.dequant(qtype, data, scales, cols, torch.empty(rows, cols))
        assert torch.equal(out, dense)  # the very values, bit for bit
    x, bias = torch.randn(n, cols, generator=g), torch.randn(rows, generator=g)
    want = F.linear(x.double(), dense.double(), bias.double())
    got = kernels.linear(qtype, data, scales, cols, x, torch.empty(n, rows), bias)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("isa", ISA_NAMES)
def test_layer_ops_equal_torch(kernels: NativeKernels, isa: str) -> None:
    _use(kernels, isa)
    g = torch.Generator().manual_seed(4)
    n, hq, hkv, d = 5, 4, 2, 16
    h, norm = torch.randn(n, 64, generator=g), torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(
        kernels.rms_norm(h, norm, 1e-5), rms_norm(h, norm, 1e-5), atol=1e-6, rtol=1e-6
    )
    cos_t, sin_t = torch.randn(50, d, generator=g), torch.randn(50, d, generator=g)
    positions = torch.tensor([0, 7, 7, 31, 49])
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    rotated = qkv.clone()
    kernels.rope(rotated, hq + hkv, d, cos_t, sin_t, positions)
    heads = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
    want = apply_rope(heads, cos_t[positions][:, None], sin_t[positions][:, None])
    assert torch.equal(rotated[:, : (hq + hkv) * d].view(n, hq + hkv, d), want)
    assert torch.equal(rotated[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :])  # v as it was
    gu = torch.randn(n, 2 * 45, generator=g) * 30  # a tail past the vector width; exp's tails
    gu[:, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])
    torch.testing.assert_close(
        kernels.swiglu(gu, 45), F.silu(gu[:, :45]) * gu[:, 45:], atol=1e-6, rtol=1e-5
    )
    cache = torch.zeros(4, 2, 2, 4, hkv, d + 4, dtype=torch.uint8)
    k, v = qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    blocks, offsets = torch.tensor([0, 3, 3, 1, 2]), torch.tensor([0, 1, 3, 2, 0])
    kernels.write_kv(cache, 1, k, v, blocks, offsets, d)
    assert torch.equal(cache[blocks, 1, 0, offsets], Int8KV(d).encode(k.reshape(n, hkv, d)))
    assert torch.equal(cache[blocks, 1, 1, offsets], Int8KV(d).encode(v.reshape(n, hkv, d)))


@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("d", [16, 12])  # 12: not a multiple of 8, the portable loops
def test_paged_decode_equals_torch(kernels: NativeKernels, isa: str, int8: bool, d: int) -> None:
    _use(kernels, isa)
    g = torch.Generator().manual_seed(d)
    nb, layers, bs, hkv, hq = 60, 2, 4, 2, 6
    lens = torch.tensor([1, 9, 33, 40])
    tables = torch.randperm(nb, generator=g)[:40].view(4, 10).contiguous()
    codec = Int8KV(d) if int8 else FLOAT_KV
    kv_f = torch.randn(nb, layers, 2, bs, hkv, d, generator=g)
    kv = codec.encode(kv_f) if int8 else kv_f
    q = torch.randn(4, hq, d, generator=g)
    meta = decode_only_meta(tables, lens, bs, layers, hkv)
    for layer in range(layers):
        want = _decode_attention(q, kv, layer, meta, d**-0.5, codec)
        got = kernels.paged_decode(q, kv, tables, lens, layer, d**-0.5)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


# -- the library itself ---------------------------------------------------------------------------


def test_every_bound_signature_is_its_prototype_in_native_h() -> None:
    """native.py passes arguments by these letters: a mismatch with the C prototype would be
    undefined behaviour, not an error."""
    header = (build.HERE / "native.h").read_text()
    letter = {"int64_t": "l", "int": "i", "float": "f"}
    for name, sig in _SIGNATURES.items():
        m = re.search(rf"\bint {name}\(([^)]*)\)", header)
        assert m is not None, name
        args = [a.strip() for a in m.group(1).split(",") if a.strip() not in ("", "void")]
        got = "".join("p" if "*" in a else letter[a.split()[0]] for a in args)
        assert got == sig, name


def test_a_prebuilt_library_is_used_only_when_built_from_these_sources(tmp_path: Path) -> None:
    if build.find_compiler() is None:
        pytest.skip("no C compiler")
    current = build.compile_library(tmp_path / "current.so")
    assert library.locate(tmp_path / "cache", prebuilt=current).path == current
    old_sources = tmp_path / "old"
    shutil.copytree(build.HERE, old_sources, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with (old_sources / "pool.c").open("a") as f:
        f.write("/* an older version */\n")
    stale = build.compile_library(tmp_path / "stale.so", root=old_sources)
    assert build.built_tag(stale) == build.source_tag(old_sources) != build.source_tag()
    loaded = library.locate(tmp_path / "cache", prebuilt=stale)
    assert loaded.lib is not None and loaded.path != stale  # compiled into the cache instead
    assert loaded.path is not None and loaded.path.parent == tmp_path / "cache" / "kernels"


def test_the_cache_is_keyed_by_sources_compiler_and_architecture_not_the_cpu_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tag, cc = build.source_tag(), ("cc",)
    monkeypatch.setattr(build, "compiler_id", lambda cc: "gcc 12")
    name = build.cache_name(tag, cc)
    assert build.cache_name("0" * 16, cc) != name
    monkeypatch.setattr(build.platform, "processor", lambda: "another CPU model")
    assert build.cache_name(tag, cc) == name  # variants are chosen at run time
    monkeypatch.setattr(build, "compiler_id", lambda cc: "clang 17")
    assert build.cache_name(tag, cc) != name
    monkeypatch.setattr(build, "compiler_id", lambda cc: "gcc 12")
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert build.cache_name(tag, cc) != name


def test_without_a_compiler_the_engine_runs_torch_and_says_why(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from cluster.engine.engine import LLMEngine
    from tests.helpers import make_config

    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(library, "PREBUILT", tmp_path / "no-prebuilt.so")
    loaded = library.locate(tmp_path / "cache", prebuilt=tmp_path / "no-prebuilt.so")
    assert loaded.lib is None and "CC='/nonexistent/cc'" in loaded.reason
    assert build.main(["--out", str(tmp_path / "lib.so")]) == 0  # make setup goes on
    assert not (tmp_path / "lib.so").exists()
    library.load_library.cache_clear()
    try:
        cfg = make_config(
            **{
                "model.path": str(tiny_model_dir),
                "paths.cache_dir": str(tmp_path / "cache"),
                "cache.num_blocks": 32,
                "model.num_threads": 2,
            }
        )
        with caplog.at_level(logging.WARNING, logger="cluster.engine.kernels.library"):
            eng = LLMEngine(cfg)
        assert eng.runner.decode_kernel is None  # type: ignore[attr-defined]
        assert eng.runner.model.ops.linear.kernels is None  # type: ignore[attr-defined]
        assert any("/nonexistent/cc" in r.getMessage() for r in caplog.records)
        with pytest.raises(ValueError, match="native library"):
            LLMEngine(cfg.replace({"model.kernels": "native"}))
    finally:
        library.load_library.cache_clear()
