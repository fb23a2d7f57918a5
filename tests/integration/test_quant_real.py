"""Acceptance (issue 9) on the real default model: the GGUF path equals the fp32-dequantized
reference and stays packed; int8 weights and int8 KV pass the accuracy gates.

- GGUF (``model.weights: gguf``, the default for the shipped Q4_1 file): greedy 64 tokens on 9
  prompts identical to transformers on the de-quantized checkpoint (a divergence only at a
  near-tie of the reference, 2e-3; logits within 1e-3 until then), weights <= 0.25x fp32.
- Teacher-forced perplexity on a 2,045-token public-domain text (tests/data): int8 weights
  within 2% of fp32, int8 KV within 1%; top-1 prediction the same as fp32's at >= 97% of
  positions. References are computed before the engines they judge. int8 weights in groups of
  32 (``model.weights: int8``) pass (0.9897, perplexity x0.9989): these weights are the
  de-quantized Q4_1 file, whose blocks line up with the groups (the formats docs say why).
  One scale per output channel (``int8_rows``) misses the top-1 gate (0.9413 measured,
  perplexity x1.0142 within its 2%): a strict xfail, so it fails the day it passes.
- ``model.numerics: fast`` (issue 39, int8 activations) against exact on the same packed
  weights (the default GGUF's, and int8 groups), teacher-forced in chunks the integer kernel
  takes: perplexity within 1%, top-1 agreement >= 98%, the gates ``NUMERICS_DEFAULT``
  (cluster/config/model.py) is held to. Measured (AVX-512 VNNI, 256-row chunks, q/k/v in fp32):
  x0.9994 and 0.990 (gguf), x1.0008 and 0.992 (int8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.models.packed import (
    _SCRATCH_FLOATS,
    PackedLinear,
    PackedWeight,
    kernel_max_rows,
)
from tests.helpers import greedy, make_config, run_until_done
from tests.quality import TEXT, teacher_forced
from tests.real_workload import NUM_NEW, RealWorkload
from tests.reference import capture_logits, check_run_against_references

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


def _engine(**overrides: Any) -> LLMEngine:
    base = {"model.num_threads": 2, "cache.num_blocks": 160, "scheduler.chunk_size": 64}
    base.update(overrides)
    return LLMEngine(make_config(**base))


def test_gguf_weights_stay_packed_and_match_the_dequantized_reference(
    real_model_dir: Path, real_workload: RealWorkload
) -> None:
    from tests.reference import load_hf

    prompts, refs = real_workload.prompts, real_workload.refs
    assert len(prompts) >= 8
    hf = load_hf(real_model_dir)  # transformers on the fp32 de-quantized checkpoint
    dense_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied: once
    del hf

    # the default model, model.weights auto: the GGUF file's own blocks, in exact numerics
    eng = _engine(**{"model.numerics": "exact"})
    model = eng.runner.model
    assert eng.config.model.resolved_weights == "gguf"
    assert eng.runner.formats["weights"] in ("Q8_0 + Q4_1", "Q4_1 + Q8_0")
    assert all(isinstance(m, PackedWeight) for m in model.matrices())
    assert model.lm_head is model.embed  # the tied Q8_0 table, once
    resident = model.weight_bytes() + _SCRATCH_FLOATS * 4  # + the tile scratch, if used
    assert resident <= 0.25 * dense_bytes, (resident, dense_bytes)

    captured = capture_logits(eng)
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(NUM_NEW)))
    tokens = run_until_done(eng)
    eng.check_integrity()
    check_run_against_references(eng, prompts, refs, tokens, captured)


@pytest.fixture(scope="module")
def text_ids(real_model_dir: Path) -> list[int]:
    from cluster.common.tokenizer import Tokenizer

    ids = Tokenizer(real_model_dir).encode(TEXT.read_text())
    assert len(ids) >= 2000
    return ids


@pytest.fixture(scope="module")
def fp32(real_model_dir: Path, text_ids: list[int]) -> Any:
    return teacher_forced(_engine(**{"model.path": str(real_model_dir)}).runner, text_ids)


@pytest.mark.parametrize(
    ("overrides", "max_ppl_increase"),
    [
        ({"model.weights": "int8"}, 0.02),
        pytest.param(
            {"model.weights": "int8_rows"},
            0.02,
            marks=pytest.mark.xfail(
                strict=True,
                reason="issue 9: one scale per output channel misses the top-1 gate (0.9413 < "
                "0.97; perplexity x1.0142 holds): model.weights=int8 uses groups of 32",
            ),
        ),
        ({"cache.kv_dtype": "int8"}, 0.01),
    ],
    ids=["int8-weights", "int8-rows-weights", "int8-kv"],
)
def test_int8_accuracy_gates(
    real_model_dir: Path,
    text_ids: list[int],
    fp32: Any,
    overrides: dict[str, Any],
    max_ppl_increase: float,
) -> None:
    eng = _engine(**{"model.path": str(real_model_dir), **overrides})
    got = teacher_forced(eng.runner, text_ids)
    ratio = got.perplexity / fp32.perplexity
    agreement = float((got.top1 == fp32.top1).float().mean())
    print(  # the figures docs/benchmarks/results.csv holds
        f"{overrides}: perplexity {got.perplexity:.4f} vs fp32 {fp32.perplexity:.4f} "
        f"(x{ratio:.4f}), top-1 agreement {agreement:.4f}"
    )
    assert ratio <= 1 + max_ppl_increase, (got.perplexity, fp32.perplexity)
    assert agreement >= 0.97, agreement


@pytest.mark.parametrize(
    "weights",
    [{}, {"model.weights": "int8"}],  # the default GGUF file's blocks; int8 groups of 32
    ids=["gguf", "int8"],
)
def test_fast_numerics_gates(
    real_model_dir: Path, text_ids: list[int], weights: dict[str, Any]
) -> None:
    """Chunks of as many rows as the fast kernel takes (every chunk on AVX-512; capped at 256)
    run on the integer kernel, and a row's result there does not depend on its chunk, so each
    position is what decoding it would compute; the exact reference is chunked alike."""
    path = {"model.path": str(real_model_dir)} if weights else {}  # int8: from the checkpoint
    exact = _engine(**path, **weights, **{"model.numerics": "exact"})  # the reference first
    lin = exact.runner.model.ops.linear
    if not isinstance(lin, PackedLinear) or lin.kernels is None:
        pytest.skip("no native library here: model.numerics fast cannot run")
    chunk = min(256, kernel_max_rows(lin.kernels.isa, packed=True, fast=True))
    ref = teacher_forced(exact.runner, text_ids, chunk=chunk)
    del exact
    fast = _engine(**path, **weights, **{"model.numerics": "fast"})
    assert fast.runner.formats["weights"].endswith(", int8 activations (fast)")
    got = teacher_forced(fast.runner, text_ids, chunk=chunk)
    ratio = got.perplexity / ref.perplexity
    agreement = float((got.top1 == ref.top1).float().mean())
    print(  # the figures docs/benchmarks/results.csv holds
        f"numerics fast vs exact, {weights or 'gguf'} weights, {chunk}-row chunks: perplexity "
        f"{got.perplexity:.4f} vs {ref.perplexity:.4f} (x{ratio:.4f}), top-1 agreement "
        f"{agreement:.4f}"
    )
    assert ratio <= 1.01, (got.perplexity, ref.perplexity)
    assert agreement >= 0.98, agreement
