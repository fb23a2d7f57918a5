"""Packed weights end to end on a tiny GGUF Llama: ``model.weights: gguf`` runs the file's own
blocks and equals transformers' de-quantized reference; int8 weights; bad files fail cleanly."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config.model_paths import COMPLETE_MARKER, gguf_model_dir
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.models.llama import LlamaModel
from cluster.engine.models.packed import PackedWeight
from tests.gguf_tiny import gguf_config, write_tiny_gguf
from tests.helpers import greedy, make_config, run_until_done
from tests.reference import NEAR_TIE, capture_logits


def _gguf_config(checkpoint: Path, root: Path, arch: str = "llama") -> Any:
    """``gguf_config`` in exact numerics: these tests compare with the de-quantized reference."""
    return gguf_config(checkpoint, root, arch, **{"model.numerics": "exact"})


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cfg = _gguf_config(tiny_model_dir, tmp_path_factory.mktemp("tiny-gguf"))
    return {"path": Path(cfg.model.path), "config": cfg}


def _run(eng: LLMEngine, n: int = 6, max_tokens: int = 24) -> dict[str, list[int]]:
    for i in range(n):
        eng.add(
            EngineRequest(f"r{i}", [3 + i * 7 + j for j in range(3 + 9 * i)], greedy(max_tokens))
        )
    out = run_until_done(eng)
    eng.check_integrity()
    return out


def test_gguf_weights_equal_the_dequantized_reference(tiny_gguf: dict[str, Any]) -> None:
    cfg = tiny_gguf["config"]
    ref = LLMEngine(cfg.replace({"model.weights": "dense"}))
    ref_logits = capture_logits(ref)
    expected = _run(ref)
    eng = LLMEngine(cfg)  # auto: a .gguf source keeps its blocks
    assert cfg.model.resolved_weights == "gguf"
    model = eng.runner.model
    assert set(eng.runner.formats["weights"].split(" + ")) == {"Q4_0", "Q4_1", "Q8_0"}
    assert all(isinstance(m, PackedWeight) for m in model.matrices())
    assert model.lm_head is model.embed  # tied: one packed table
    # The packed rows are the reference's values exactly, q/k rows un-permuted as transformers does.
    dense = ref.runner.model
    for lw, rw in zip(model.layers, dense.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(lw, name).dequantize(), getattr(rw, name)), name
    got = _run(eng)
    for rid, toks in expected.items():
        for i, (a, b) in enumerate(zip(got[rid], toks)):
            if a != b:  # only a genuine near-tie may diverge
                top = ref_logits[(rid, i)].topk(2).values
                assert float(top[0] - top[1]) <= NEAR_TIE, (rid, i)
                break
    assert sum(got[r] == expected[r] for r in expected) >= len(expected) - 1


def test_gguf_without_the_native_kernel_is_the_same_model(tiny_gguf: dict[str, Any]) -> None:
    cfg = tiny_gguf["config"]
    native = _run(LLMEngine(cfg), n=3)
    torch_path = _run(LLMEngine(cfg.replace({"model.kernels": "torch"})), n=3)
    assert native == torch_path


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_one_call_decode_step_is_the_per_layer_loop_bit_for_bit(
    tiny_gguf: dict[str, Any], kv_dtype: str
) -> None:
    """Decode-only steps run every layer in one C call (kernels/decode_forward.c); the same
    kernels in the same order as the per-layer loop, so the logits are identical, not close."""
    _whole_equals_loop(tiny_gguf["config"].replace({"cache.kv_dtype": kv_dtype}), n=5)


def test_a_wide_one_call_decode_step_splits_its_small_ops_bit_for_bit(
    tiny_gguf: dict[str, Any],
) -> None:
    """12 decode rows at up to ~110 tokens of context: enough work that the one-call step splits
    SwiGLU and the attention between the threads; each value is still computed as the per-layer
    loop computes it."""
    # every prompt prefilled in the first step, so the 12 rows then decode together
    cfg = tiny_gguf["config"].replace({"cache.num_blocks": 256, "scheduler.chunk_size": 256})
    _whole_equals_loop(cfg, n=12, kernel_max_rows=64)


def _whole_equals_loop(cfg: Any, n: int, kernel_max_rows: int | None = None) -> None:
    whole, loop = LLMEngine(cfg), LLMEngine(cfg)
    if kernel_max_rows is not None:  # both on the kernel path at this width, whatever the rule
        for e in (whole, loop):
            e.runner.model.ops.packed.kernel_max_rows = kernel_max_rows  # type: ignore[attr-defined]
    loop.runner.model.ops._whole = False  # type: ignore[attr-defined]  # never the one call
    calls = []
    ops: Any = whole.runner.model.ops
    run_layers = ops.run_layers
    ops.run_layers = lambda *a: calls.append(run_layers(*a)) or calls[-1]
    logits = [capture_logits(e) for e in (whole, loop)]
    outs = [_run(e, n=n, max_tokens=12) for e in (whole, loop)]
    assert outs[0] == outs[1]
    assert logits[0].keys() == logits[1].keys()
    for key, row in logits[0].items():
        assert torch.equal(row, logits[1][key]), key
    assert True in calls and False in calls  # decode-only steps did; prefill steps did not
    assert torch.equal(whole.runner.kv_cache, loop.runner.kv_cache)  # the same KV written


@pytest.mark.parametrize(("weights", "fmt"), [("int8", "int8g32"), ("int8_rows", "int8")])
def test_int8_weights_quantize_every_matrix(tiny_model_dir: Path, weights: str, fmt: str) -> None:
    """int8: groups of 32 inputs (fp16 scale and minimum each); int8_rows: one scale per row."""
    cfg = make_config(
        **{"model.path": str(tiny_model_dir), "cache.num_blocks": 96, "model.num_threads": 2}
    )
    dense = LLMEngine(cfg)
    eng = LLMEngine(cfg.replace({"model.weights": weights, "model.numerics": "exact"}))
    model = eng.runner.model
    assert eng.runner.formats["weights"] == fmt
    assert all(isinstance(m, PackedWeight) for m in model.matrices())
    assert model.lm_head is model.embed  # the tied embedding is quantized once
    for lw, rw in zip(model.layers, dense.runner.model.layers):
        w, ref = lw.gate_up.dequantize(), rw.gate_up
        if weights == "int8_rows":
            step = ref.abs().amax(dim=1, keepdim=True) / 127
        else:  # each group's own range over 255 levels (+ fp16's rounding of its minimum)
            g = ref.reshape(ref.shape[0], -1, 32)
            step = ((g.amax(dim=2) - g.amin(dim=2)) / 255).repeat_interleave(32, dim=1) * 1.01
            step = step + 2 * 1e-3 * ref.abs().amax()  # fp16 m: 11 bits
        assert bool(((w - ref).abs() <= step / 2 * (1 + 1e-5)).all())  # round to nearest
    assert model.weight_bytes() < 0.3 * dense.runner.model.weight_bytes()  # 1.125 B/weight
    # The int8 engine computes the model whose weights are the int8 values: the dense engine
    # running on the de-quantized int8 matrices gives the same logits (fp32 summation order
    # aside). The accuracy gate on the real model: tests/integration/test_quant_real.py.
    ref = dense.runner.model
    for lw, rw in zip(model.layers, ref.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(rw, name, getattr(lw, name).dequantize())
    ref.embed = ref.lm_head = model.embed.dequantize()  # type: ignore[union-attr]
    logits = [capture_logits(e) for e in (dense, eng)]
    _run(dense, max_tokens=4), _run(eng, max_tokens=4)
    for key, ref_row in logits[0].items():
        err = float((logits[1][key] - ref_row).abs().max())
        assert err <= 1e-4 * float(ref_row.abs().max()), (key, err)


def _broken_gguf(tiny_model_dir: Path, tmp_path: Path, **kw: Any) -> Any:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "broken.gguf", **kw)
    cfg = make_config(
        **{
            "model.path": str(path),
            "paths.cache_dir": str(tmp_path / "cache"),
            "cache.num_blocks": 32,
            "model.weights": "gguf",
        }
    )
    target = gguf_model_dir(cfg, path)
    shutil.copytree(tiny_model_dir, target)  # its config and tokenizer: the file is the problem
    (target / COMPLETE_MARKER).write_text("test\n")
    return cfg


def _live(kind: type) -> int:
    gc.collect()
    return sum(isinstance(o, kind) for o in gc.get_objects())


def test_an_unsupported_tensor_type_is_named_and_nothing_stays_loaded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _broken_gguf(tiny_model_dir, tmp_path, types={"ffn_down": "Q5_0"})
    before = (_live(PackedWeight), _live(LlamaModel))
    with pytest.raises(ValueError) as e:
        LLMEngine(cfg)
    msg = str(e.value)
    assert "'blk.0.ffn_down.weight'" in msg and "Q5_0" in msg and "model.weights=dense" in msg
    e.value.__traceback__ = None  # what a caller that keeps the error holds
    del e
    assert (_live(PackedWeight), _live(LlamaModel)) == before
    # The same file de-quantized through transformers is fine: dense reads the checkpoint.
    assert LLMEngine(cfg.replace({"model.weights": "dense"})).runner.formats["weights"]


def test_an_unknown_gguf_architecture_is_refused_before_loading(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _broken_gguf(tiny_model_dir, tmp_path, arch="mamba")
    before = _live(PackedWeight)
    with pytest.raises(ValueError, match="GGUF architecture 'mamba'.*supported: llama"):
        LLMEngine(cfg)
    assert _live(PackedWeight) == before


def test_gguf_weights_need_a_gguf_source(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.weights: gguf needs a GGUF source"):
        make_config(**{"model.path": str(tiny_model_dir), "model.weights": "gguf"})
    with pytest.raises(ValueError, match="model.weights: unknown value 'q4'"):
        make_config(**{"model.weights": "q4"})


# Qwen3-MoE: 4 experts of 768 rows (the size transformers' GGUF loader assumes: it reads neither
# expert_feed_forward_length nor dense layers among the sparse ones), every layer sparse
QWEN_GGUF = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": (
        "qwen3moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 768,
            "head_dim": 16,
            "norm_topk_prob": True,
        },
    ),
}


@pytest.mark.parametrize("family", sorted(QWEN_GGUF))
def test_qwen_ggufs_keep_their_blocks_rows_in_order_biases_and_norms(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """Qwen2, Qwen3 and Qwen3-MoE from GGUF: the packed q/k/v and gate/up rows (every
    expert's, from the stacked expert tensors) are the de-quantized reference's exactly (no
    RoPE permutation: llama.cpp keeps their rows in order), Qwen2's q/k/v biases and Qwen3's
    q/k norms are its vectors, and generation equals the dense model's (Qwen3's head_dim, 128,
    is not hidden / heads: the file names it)."""
    from cluster.engine.models.tiny import build_tiny_llama

    gguf_arch, extra = QWEN_GGUF[family]
    root = tmp_path_factory.mktemp(f"tiny-{family}-gguf")
    checkpoint = build_tiny_llama(root / "ckpt", family=family, **extra)
    cfg = _gguf_config(checkpoint, root, gguf_arch)
    ref = LLMEngine(cfg.replace({"model.weights": "dense"}))
    eng = LLMEngine(cfg)
    model, dense = eng.runner.model, ref.runner.model
    qwen2 = family == "qwen2"
    assert model.arch.qkv_bias == qwen2 and model.arch.qk_norm == (not qwen2)
    assert all(isinstance(m, PackedWeight) for m in model.matrices())
    for lw, rw in zip(model.layers, dense.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            if getattr(rw, name) is not None:
                assert torch.equal(getattr(lw, name).dequantize(), getattr(rw, name)), name
        if rw.moe is not None:  # every expert's packed rows, and the router
            assert lw.moe is not None and torch.equal(lw.moe.router, rw.moe.router)
            for ours, theirs in zip(lw.moe.matrices(), rw.moe.matrices(), strict=True):
                assert torch.equal(ours.dequantize(), theirs)
        if qwen2:
            assert lw.qkv_bias is not None and torch.equal(lw.qkv_bias, rw.qkv_bias)
        else:
            assert lw.qk_norm is not None and rw.qk_norm is not None
            assert all(torch.equal(a, b) for a, b in zip(lw.qk_norm, rw.qk_norm, strict=True))
    ref_logits = capture_logits(ref)
    expected, got = _run(ref, n=4), _run(eng, n=4)
    for rid, toks in expected.items():
        for i, (a, b) in enumerate(zip(got[rid], toks)):
            if a != b:  # only a genuine near-tie may diverge
                top = ref_logits[(rid, i)].topk(2).values
                assert float(top[0] - top[1]) <= NEAR_TIE, (rid, i)
                break
    assert sum(got[r] == expected[r] for r in expected) >= len(expected) - 1
