"""The paged engine against a transformers greedy loop, on tiny random models of each dense
family (Llama; Qwen3, whose per-head q/k norms and explicit head_dim the Llama path lacks;
Phi-3, whose q/k/v and gate/up projections are fused in the checkpoint; Mixtral and Qwen3-MoE,
whose MLPs are mixtures of experts; Gemma 3 text, with its norms around each sublayer, GeGLU,
scaled embedding and a RoPE base per layer type).

Same checks as the real-model integration test: a batch of prompts of different lengths
submitted together, small chunks, prefix-cache hits, preemption. Each run ends idle and clean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import greedy, run_until_done, tiny_config
from tests.reference import (
    Reference,
    capture_logits,
    check_run_against_references,
    hf_greedy,
    hf_greedy_batch,
)
from tests.tiny_families import FAMILIES

NUM_NEW = 24
TEXT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a small model "
    "that learned to count: one, two, three, four, five, six, seven, eight, nine, ten. "
) * 4


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine(tiny_config(model_dir, **{"cache.num_blocks": 512, **overrides}))


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    if request.param == "llama":
        return tiny_model_dir
    from cluster.engine.models.tiny import build_tiny_llama

    family = request.param
    return build_tiny_llama(tmp_path_factory.mktemp(family), family=family, **FAMILIES[family])


@pytest.fixture(scope="module")
def setup(model_dir: Path) -> tuple[dict[str, list[int]], dict[str, Reference], Any]:
    from tests.reference import load_hf

    tiny_model_dir = model_dir

    eng = _engine(tiny_model_dir)
    tok = eng.tokenizer
    words = TEXT.split()
    prompts = {}
    for i, n in enumerate([1, 3, 9, 16, 17, 33, 50, 75, 120]):
        prompts[f"r{i}"] = tok.encode(" ".join(words[i : i + n]))
    # Prompts sharing a long prefix (3+ full blocks), for prefix-cache hits.
    shared = tok.encode(TEXT)[:56]
    for i in range(3):
        prompts[f"s{i}"] = shared + tok.encode(f" number {i} is here")
    hf = load_hf(tiny_model_dir)
    suppress = tuple(eng.eos_token_ids)
    refs = {rid: hf_greedy(hf, p, NUM_NEW, suppress) for rid, p in prompts.items()}
    # The real-model session references come from the batched loop: it must agree with batch 1.
    batched = hf_greedy_batch(hf, list(prompts.values()), NUM_NEW, suppress)
    for (rid, ref), got in zip(refs.items(), batched, strict=True):
        assert got.tokens == ref.tokens, rid
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits, strict=True))
        assert diff <= 1e-4, f"{rid}: batched reference logits differ by {diff:.2e}"
    return prompts, refs, eng


def _run(eng: LLMEngine, prompts: dict[str, list[int]], suffix: str = "") -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid + suffix, p, greedy(NUM_NEW)))
    out = run_until_done(eng)
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return {rid.removesuffix(suffix) if suffix else rid: toks for rid, toks in out.items()}


def test_batched_chunked_prefill_matches_reference(setup: Any) -> None:
    prompts, refs, eng = setup
    captured = capture_logits(eng)
    tokens = _run(eng, prompts)
    check_run_against_references(eng, prompts, refs, tokens, captured)
    # Chunks of 16 under a 64-token budget: long prompts took several steps, mixed with decodes.
    assert eng.stats()["num_steps"] > NUM_NEW


def test_prefix_cache_hits_match_reference(model_dir: Path, setup: Any) -> None:
    prompts, refs, _ = setup
    eng = _engine(model_dir)
    first = _run(eng, prompts, suffix="-a")
    captured = capture_logits(eng)
    second = _run(eng, prompts, suffix="-b")
    assert eng.stats()["num_cached_prompt_tokens"] > 0
    for rid in prompts:
        assert first[rid] == second[rid]
    check_run_against_references(
        eng,
        {f"{r}-b": p for r, p in prompts.items()},
        {f"{r}-b": v for r, v in refs.items()},
        {f"{r}-b": v for r, v in second.items()},
        captured,
    )


def test_preemption_matches_reference(model_dir: Path, setup: Any) -> None:
    prompts, refs, _ = setup
    # 20 blocks of 16 tokens cannot hold the batch (about 60 blocks at the end): preemption.
    eng = _engine(model_dir, **{"cache.num_blocks": 20, "scheduler.max_num_seqs": 16})
    captured = capture_logits(eng)
    tokens = _run(eng, prompts)
    assert eng.scheduler.num_preemptions > 0
    check_run_against_references(eng, prompts, refs, tokens, captured)


def test_unchunked_large_budget_matches_reference(model_dir: Path, setup: Any) -> None:
    prompts, refs, _ = setup
    eng = _engine(
        model_dir,
        **{"scheduler.chunk_size": None, "scheduler.max_num_batched_tokens": 2048},
    )
    captured = capture_logits(eng)
    tokens = _run(eng, prompts)
    check_run_against_references(eng, prompts, refs, tokens, captured)
