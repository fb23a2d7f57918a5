"""``model.numerics: fast`` (issue 39): packed weights multiplied with int8 activations.

The plumbing: ``PackedLinear(fast=True)`` and the one-call decode step pass packed segments'
type ids or'ed with ``FAST`` (never F32's, never on the tiles path), every packed matrix of a
model follows the mode (GGUF blocks, int8-quantized models, experts), the engine reports it, and
fast stays close to exact (teacher-forced top-1 agreement on a tiny model), batch-invariant (a
row alone equals it in a batch, bit for bit) and exact under speculative decoding. The quality
gates on the real model: tests/integration/test_quant_real.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.kernels.decode_forward import DecodeForward, _matrix
from cluster.engine.kernels.quant import F32, FAST, INT8_G32, Q4_1, Q8_0, PackedRows
from cluster.engine.models.int8 import quantize_int8_groups
from cluster.engine.models.packed import KERNEL_MAX_ROWS, PackedLinear, PackedWeight
from tests.gguf_tiny import gguf_config
from tests.helpers import greedy, make_config, run_until_done
from tests.quality import teacher_forced
from tests.reference import capture_logits

FAST_SUFFIX = ", int8 activations (fast)"


# -- the flag ---------------------------------------------------------------------------------


class RecordingKernels:
    """A stand-in for ``NativeKernels``: records the type id of each linear call and computes
    the de-quantized product."""

    isa = "avx2"

    def __init__(self) -> None:
        self.qtypes: list[int] = []

    def linear(self, qtype: int, data: Any, scales: Any, cols: int, x: Any, out: Any,
               bias: Any = None, accumulate: bool = False) -> torch.Tensor:  # fmt: skip
        self.qtypes.append(qtype)
        w = PackedRows(qtype & ~FAST, data, scales)
        dense = w.data if w.qtype == F32 else PackedWeight((w,), cols).dequantize()
        y = F.linear(x, dense, bias)
        rows = y.shape[1]
        out[:, :rows] = out[:, :rows] + y if accumulate else y
        return out


def _mixed() -> PackedWeight:
    """Three segments: int8 groups, F32 rows, int8 groups."""
    g = torch.Generator().manual_seed(0)
    a, b = quantize_int8_groups(torch.randn(8, 64, generator=g)), torch.randn(4, 64, generator=g)
    f32 = PackedWeight((PackedRows(F32, b, None),), 64)
    return PackedWeight((*a.segments, *f32.segments, *a.segments), 64)


@pytest.mark.parametrize("fast", [False, True])
def test_packed_linear_flags_packed_segments_only_when_fast(fast: bool) -> None:
    kernels = RecordingKernels()
    linear = PackedLinear(kernels, fast=fast)  # type: ignore[arg-type]
    w, x = _mixed(), torch.randn(3, 64)
    torch.testing.assert_close(linear(x, w, None), F.linear(x, w.dequantize()))
    packed = INT8_G32 | FAST if fast else INT8_G32
    assert kernels.qtypes == [packed, F32, packed]  # F32 rows never get the flag
    kernels.qtypes.clear()
    h = torch.zeros(3, 20)
    assert linear.accumulate(h, x, w) and kernels.qtypes == [packed, F32, packed]
    kernels.qtypes.clear()
    linear(x, torch.randn(5, 64), None)  # a dense weight: the F32 kernel, unflagged
    assert kernels.qtypes == [F32]


def test_the_rule_has_a_column_for_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tunable per mode (today fast's rows are packed's: the integer kernel is unmeasured)."""
    assert all(rule["fast"] >= 1 for rule in KERNEL_MAX_ROWS.values())
    monkeypatch.setitem(KERNEL_MAX_ROWS["avx2"], "fast", 7)
    kernels: Any = RecordingKernels()
    assert PackedLinear(kernels, fast=True).max_rows(packed=True) == 7
    assert (
        PackedLinear(kernels, fast=True).max_rows(packed=False) == KERNEL_MAX_ROWS["avx2"]["dense"]
    )
    assert PackedLinear(kernels).kernel_max_rows == KERNEL_MAX_ROWS["avx2"]["packed"]


def test_q4_1_and_q8_0_segments_are_flagged_in_fused_matrices() -> None:
    """A fused matrix of two block formats: each segment keeps its own type, or'ed with FAST."""
    import gguf

    g = torch.Generator().manual_seed(1)
    parts = []
    for qtype in (Q4_1, Q8_0):
        w = torch.randn(8, 64, generator=g)
        data = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(qtype))
        parts.append(PackedWeight.of(qtype, torch.from_numpy(data), 64))
    fused = PackedWeight.cat(parts)
    kernels = RecordingKernels()
    PackedLinear(kernels, fast=True)(torch.randn(2, 64), fused, None)  # type: ignore[arg-type]
    assert kernels.qtypes == [Q4_1 | FAST, Q8_0 | FAST]


def test_the_tiles_path_is_the_same_in_both_modes() -> None:
    """Past ``kernel_max_rows`` rows packed rows are de-quantized for BLAS either way."""
    kernels = RecordingKernels()
    dequantized: list[int] = []

    def dequant(qtype: int, data: Any, scales: Any, cols: int, out: Any, row0: int = 0) -> Any:
        dequantized.append(qtype)
        rows = PackedWeight((PackedRows(qtype, data, scales),), cols).dequantize()
        return out.copy_(rows[row0 : row0 + out.shape[0]])

    kernels.dequant = dequant  # type: ignore[attr-defined]
    linear = PackedLinear(kernels, fast=True)  # type: ignore[arg-type]
    linear.kernel_max_rows = 2
    w, x = _mixed(), torch.randn(5, 64)
    torch.testing.assert_close(linear(x, w, None), F.linear(x, w.dequantize()))
    assert kernels.qtypes == [] and dequantized == [INT8_G32, INT8_G32]


def test_the_one_call_step_describes_packed_segments_with_the_flag() -> None:
    w = _mixed()
    for fast in (False, True):
        m = _matrix(w.cols, w.segments, fast)
        packed = INT8_G32 | FAST if fast else INT8_G32
        assert list(m.qtype)[: m.num_segments] == [packed, F32, packed]


# -- engines on tiny models ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Llama as GGUF (Q4_0, Q4_1 and Q8_0 blocks), served as a ``.gguf`` model.path."""
    return gguf_config(tiny_model_dir, tmp_path_factory.mktemp("fast-gguf"))


@pytest.fixture(scope="module", params=["gguf", "int8"])
def tiny_packed(request: pytest.FixtureRequest, tiny_gguf: Any, tiny_model_dir: Path) -> Any:
    """Packed weights of both origins: a GGUF file's blocks, a checkpoint quantized at load."""
    if request.param == "gguf":
        return tiny_gguf
    return tiny_gguf.replace({"model.path": str(tiny_model_dir), "model.weights": "int8"})


def _kernel_ops(eng: LLMEngine) -> Any:
    ops = eng.runner.model.ops
    if getattr(ops, "kernels", None) is None:
        pytest.skip("no native library here (no C compiler): fast cannot run")
    return ops


def _spy(eng: LLMEngine) -> list[int]:
    """The type ids of the packed (not F32) linear calls ``eng`` makes from now on."""
    kernels = _kernel_ops(eng).kernels
    seen: list[int] = []
    linear = kernels.linear

    def spy(qtype: int, *args: Any, **kw: Any) -> torch.Tensor:
        if qtype != F32:
            seen.append(qtype)
        return linear(qtype, *args, **kw)

    kernels.linear = spy
    return seen


def _generate(eng: LLMEngine, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(n)))
    out = run_until_done(eng)
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return out


PROMPTS = {f"r{i}": [3 + (i * 11 + j * 5) % 400 for j in range(4 + 3 * i)] for i in range(4)}


def test_fast_runs_every_packed_matrix_with_int8_activations_close_to_exact(
    tiny_packed: Any,
) -> None:
    exact = LLMEngine(tiny_packed.replace({"model.numerics": "exact"}))
    fast = LLMEngine(tiny_packed.replace({"model.numerics": "fast"}))
    ops = _kernel_ops(fast)
    assert ops.packed.fast and not _kernel_ops(exact).packed.fast
    assert fast.runner.formats["weights"] == exact.runner.formats["weights"] + FAST_SUFFIX
    flagged, unflagged = _spy(fast), _spy(exact)
    outs = [_generate(e, PROMPTS, 6) for e in (exact, fast)]
    assert all(len(t) == 6 for out in outs for t in out.values())
    # Every step, prefill chunks too, ran its layers in one call (rows_as_decodes): the calls
    # from Python are the lm_head's, with int8 activations; q/k/v keep fp32 ones.
    assert fast.runner.rows_as_decodes and not exact.runner.rows_as_decodes
    assert all(lw.qkv.fp32_activations for lw in fast.runner.model.layers)
    assert flagged and all(q & FAST for q in flagged)
    assert unflagged and not any(q & FAST for q in unflagged)
    # The one call's matrices are described with the flag (q/k/v not).
    assert isinstance(ops._whole, DecodeForward)
    layer = ops._whole._layers[0]
    assert not any(layer.qkv.qtype[i] & FAST for i in range(layer.qkv.num_segments))
    for m in (layer.o, layer.gate_up, layer.down):
        assert all(m.qtype[i] & FAST for i in range(m.num_segments))
    # Teacher-forced over kernel-sized chunks (where the mode applies): the same top-1 nearly
    # everywhere (0.94 and 0.96 measured on these tiny models; the real model: test_quant_real).
    ids = [3 + (i * 37) % 400 for i in range(160)]
    chunk = ops.packed.kernel_max_rows
    got = [teacher_forced(e.runner, ids, chunk=chunk) for e in (exact, fast)]
    agreement = float((got[0].top1 == got[1].top1).float().mean())
    assert agreement >= 0.9, agreement
    assert got[1].perplexity <= 1.05 * got[0].perplexity, (got[1].perplexity, got[0].perplexity)


def test_a_row_alone_equals_it_in_a_batch_of_four_in_fast_mode(tiny_gguf: Any) -> None:
    """Every step on the kernel path (its rule raised to cover the prefill steps too): each
    row's activations are quantized on their own and each output summed in one order, so the
    logits of r0 decoded alone and decoded beside three others are identical."""
    cfg = tiny_gguf.replace({"model.numerics": "fast"})
    alone, batch = LLMEngine(cfg), LLMEngine(cfg)
    for e in (alone, batch):
        _kernel_ops(e).packed.kernel_max_rows = 64
    logits = [capture_logits(e) for e in (alone, batch)]
    out_alone = _generate(alone, {"r0": PROMPTS["r0"]}, 10)
    out_batch = _generate(batch, PROMPTS, 10)
    assert out_alone["r0"] == out_batch["r0"]
    for i in range(10):
        assert torch.equal(logits[0][("r0", i)], logits[1][("r0", i)]), i


def test_experts_follow_the_mode(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Mixtral quantized to int8: every expert's matrices run through the model's
    ``PackedLinear``, so they get int8 activations too."""
    from cluster.engine.models.tiny import build_tiny_llama
    from tests.tiny_families import FAMILIES

    root = tmp_path_factory.mktemp("fast-moe")
    ckpt = build_tiny_llama(root / "mixtral", family="mixtral", **FAMILIES["mixtral"])
    cfg = make_config(
        **{
            "model.path": str(ckpt),
            "model.weights": "int8",
            "model.numerics": "fast",
            "model.num_threads": 2,
            "cache.num_blocks": 64,
        }
    )
    eng = LLMEngine(cfg)
    assert eng.runner.formats["weights"] == "int8g32" + FAST_SUFFIX
    kernels = _kernel_ops(eng).kernels
    experts = {
        s.data.data_ptr()
        for lw in eng.runner.model.layers
        if lw.moe is not None
        for m in lw.moe.matrices()
        for s in m.segments
    }
    calls: dict[int, int] = {}
    linear = kernels.linear

    def spy(qtype: int, data: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls[data.data_ptr()] = qtype
        return linear(qtype, data, *args, **kw)

    kernels.linear = spy
    _generate(eng, PROMPTS, 4)
    used = experts & set(calls)
    assert len(used) >= 4  # several experts ran, each flagged
    assert all(calls[p] == INT8_G32 | FAST for p in used)


def test_greedy_drafts_equal_no_drafts_in_fast_mode(tiny_gguf: Any) -> None:
    """Verification rows are decode rows: with every step of the decode phase on the kernel
    (3 requests x (1 + 4 drafts) rows), greedy tokens and every verified row's logits equal
    fast mode without drafts."""
    from tests.spec_helpers import ScriptedProposer, use_proposer

    cfg = tiny_gguf.replace(
        {
            "model.numerics": "fast",
            "scheduler.chunk_size": 256,  # every prompt prefilled in the first step
            "decode.speculative.num_speculative_tokens": 4,
            "decode.speculative.measure_row_cost": False,
        }
    )
    off = LLMEngine(cfg)
    on = LLMEngine(cfg.replace({"decode.speculative.method": "ngram"}))
    if _kernel_ops(off).packed.kernel_max_rows < 15:
        pytest.skip("this instruction set's rule puts a 15-row step on the tiles path")
    prompts = {rid: PROMPTS[rid] for rid in ("r1", "r2", "r3")}
    ref_logits = capture_logits(off)
    expected = _generate(off, prompts, 20)
    got_logits = capture_logits(on)
    use_proposer(on, ScriptedProposer(expected, on.vocab_size, wrong_share=0.3))
    assert _generate(on, prompts, 20) == expected
    assert on.stats()["spec"]["num_accepted_tokens"] > 0
    for key, row in got_logits.items():
        assert torch.equal(row, ref_logits[key]), key


def test_fast_needs_the_native_kernels_of_a_cpu_fp32_model(tiny_model_dir: Path) -> None:
    cfg = make_config(
        **{
            "model.path": str(tiny_model_dir),
            "model.weights": "int8",
            "model.numerics": "fast",
            "model.dtype": "bfloat16",
            "cache.num_blocks": 16,
        }
    )
    with pytest.raises(ValueError, match=r"^model\.numerics: fast needs the native kernels"):
        LLMEngine(cfg)
    # auto stays exact where fast cannot run
    eng = LLMEngine(cfg.replace({"model.numerics": "auto"}))
    assert not eng.runner.formats["weights"].endswith(FAST_SUFFIX)


def test_auto_is_fast_only_where_the_integer_kernels_pay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``numerics_for``: auto is exact today (``NUMERICS_DEFAULT``); were the default fast, auto
    would mean fast with the AVX-512 integer kernels, and exact capped to AVX2 (no faster than
    the exact kernel there); explicit fast stays fast."""
    from cluster.engine.kernels.native import load_native
    from cluster.engine.torch_runner import FAST_PAYS, numerics_for

    cfg = make_config(**{"model.weights": "gguf"})
    kernels = load_native(cfg.paths.resolved_cache_dir, 1)
    if kernels is None:
        pytest.skip("no native library")
    assert numerics_for(cfg, True, "cpu float32") == "exact"
    monkeypatch.setattr("cluster.config.model.NUMERICS_DEFAULT", "fast")
    try:
        kernels.set_qlinear_isa("avx2")
        assert numerics_for(cfg, True, "cpu float32") == "exact"
        assert numerics_for(cfg.replace({"model.numerics": "fast"}), True, "cpu float32") == "fast"
        kernels.set_qlinear_isa(None)
        want = "fast" if kernels.qlinear_isa in FAST_PAYS else "exact"
        assert numerics_for(cfg, True, "cpu float32") == want
        assert numerics_for(cfg, False, "cuda bfloat16") == "exact"
        with pytest.raises(ValueError, match="fast needs the native kernels .* not cuda"):
            numerics_for(cfg.replace({"model.numerics": "fast"}), False, "cuda bfloat16")
    finally:
        kernels.set_qlinear_isa(None)


def test_a_prompts_logits_do_not_depend_on_its_chunking_or_prefix_hits_in_fast_mode(
    tiny_gguf: Any,
) -> None:
    """Int8 activations turn any last-bit difference upstream into a rounding step, so under
    fast numerics every row runs the same arithmetic whichever step computes it: a prompt
    prefilled in one step, in 3-token chunks, or after a prefix-cache hit (its cached blocks
    plus the rest) gives the same logits, bit for bit, at every output token."""
    cfg = tiny_gguf.replace({"model.numerics": "fast"})
    prompt = [3 + (j * 7) % 400 for j in range(37)]
    runs = []
    for chunk in (256, 3):
        eng = LLMEngine(cfg.replace({"scheduler.chunk_size": chunk}))
        if eng.runner.model.ops.packed.kernel_max_rows < 64:
            pytest.skip("this instruction set's rule puts a 37-row step on the tiles path")
        logits = capture_logits(eng)
        for rid in ("a", "b") if chunk == 3 else ("a",):
            # "b": the same prompt again, 32 of its tokens from the prefix cache
            out = _generate(eng, {rid: prompt}, 8)[rid]
            runs.append((out, {i: t for (r, i), t in logits.items() if r == rid}))
        assert eng.stats()["num_cached_prompt_tokens"] >= (32 if chunk == 3 else 0)
    (tokens, ref), *others = runs
    assert len(ref) == 8
    for got, logits in others:
        assert got == tokens
        assert logits.keys() == ref.keys()
        for key, row in logits.items():
            assert torch.equal(row, ref[key]), key
