"""Acceptance: the engine on the real default model is token-identical to transformers.

Greedy, 64 new tokens, EOS suppressed (``min_tokens == max_tokens``, as the reference's
``min_new_tokens``), a batch of prompts of different lengths submitted together, with 16-token
chunks, with prefix-cache hits (prompts sharing a long prefix, run twice), and under preemption.
References are computed first (tests/real_workload.py), before any engine runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import greedy, make_config, run_until_done
from tests.real_workload import NUM_NEW, RealWorkload
from tests.reference import (
    Reference,
    assert_matches_reference,
    capture_logits,
    check_run_against_references,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workload(real_workload: RealWorkload) -> tuple[dict[str, list[int]], dict[str, Reference]]:
    assert len({len(p) for p in real_workload.prompts.values()}) >= 8
    return real_workload.prompts, real_workload.refs


def _engine(real_model_dir: Path, **overrides: Any) -> LLMEngine:
    base = {
        "model.path": str(real_model_dir),
        "scheduler.chunk_size": 16,
        "scheduler.max_num_batched_tokens": 128,
        "cache.num_blocks": 256,
    }
    base.update(overrides)
    return LLMEngine(make_config(**base))


def _run(eng: LLMEngine, prompts: dict[str, list[int]], tag: str) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.add(EngineRequest(f"{tag}{rid}", p, greedy(NUM_NEW)))
    out = run_until_done(eng)
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return {rid.removeprefix(tag): toks for rid, toks in out.items()}


def _check(eng: LLMEngine, prompts: Any, refs: Any, tokens: Any, captured: Any, tag: str) -> None:
    check_run_against_references(
        eng,
        {f"{tag}{r}": p for r, p in prompts.items()},
        {f"{tag}{r}": v for r, v in refs.items()},
        {f"{tag}{r}": v for r, v in tokens.items()},
        captured,
    )


def test_chunked_batch_and_prefix_hits_match_transformers(
    real_model_dir: Path, workload: Any
) -> None:
    prompts, refs = workload
    eng = _engine(real_model_dir)
    captured = capture_logits(eng)
    first = _run(eng, prompts, "a-")
    _check(eng, prompts, refs, first, captured, "a-")
    second = _run(eng, prompts, "b-")  # the same prompts again: served from the prefix cache
    assert eng.stats()["num_cached_prompt_tokens"] >= sum(len(p) for p in prompts.values()) // 2
    _check(eng, prompts, refs, second, captured, "b-")


def test_preemption_matches_transformers(real_model_dir: Path, workload: Any) -> None:
    prompts, refs = workload
    # ~40 blocks cannot hold nine requests of up to ~130 tokens each at once: preemption.
    eng = _engine(real_model_dir, **{"cache.num_blocks": 40, "cache.enable_prefix_caching": False})
    captured = capture_logits(eng)
    tokens = _run(eng, prompts, "p-")
    assert eng.scheduler.num_preemptions > 0
    _check(eng, prompts, refs, tokens, captured, "p-")


@pytest.mark.parametrize(
    ("split", "weights"),
    [("tensor", "auto"), ("tensor", "dense"), ("pipeline", "auto")],
)
def test_two_ranks_match_transformers(
    real_model_dir: Path, workload: Any, split: str, weights: str
) -> None:
    """The default model over two ranks: split by heads (6 + 3 query heads, 2 + 1 KV heads; its
    GGUF blocks or de-quantized fp32), or by layers (15 + 15, in micro-batches): the same
    acceptance as one rank, chunks and prefix hits."""
    prompts, refs = workload
    eng = _engine(
        real_model_dir,
        **{f"model.{split}_parallel_size": 2, "model.num_threads": 1, "model.weights": weights},
    )
    try:
        if split == "pipeline":  # the stages' logits come back in micro-batches: tokens only
            for tag in ("t-", "u-"):
                for rid, toks in _run(eng, prompts, tag).items():
                    assert_matches_reference(toks, refs[rid], rid)
            return
        captured = capture_logits(eng)
        first = _run(eng, prompts, "t-")
        _check(eng, prompts, refs, first, captured, "t-")
        second = _run(eng, prompts, "u-")  # from the prefix cache the ranks share
        _check(eng, prompts, refs, second, captured, "u-")
    finally:
        eng.close()
