"""Acceptance: speculative decoding on the real default model is token-identical to none.

Greedy, EOS ignored, a batch of 10 prompts of different lengths (copy-heavy ones from the P9
workload among them) submitted together, with 16-token chunks, prefix-cache hits (the chat
prompts share a system prompt, and the batch runs twice) and forced preemption. References are
the same engine without speculation, computed first. Prompt lookup must have drafted and been
right often on the copy-heavy prompts, or the test would check nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.spec_workloads import copy_heavy
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import greedy, make_config, run_until_done

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NUM_NEW = 32
SYSTEM = "You are a careful assistant. Answer briefly and quote the text you are given exactly."
QUESTIONS = ["What is the capital of France?", "List three prime numbers."]
RAW = ["The quick brown fox", "def fibonacci(n):\n    ", "1, 1, 2, 3, 5, 8, 13,"]


def _engine(model_dir: Path, spec: bool, **overrides: Any) -> LLMEngine:
    base: dict[str, Any] = {
        "model.path": str(model_dir),
        "model.num_threads": 2,
        "scheduler.chunk_size": 16,
        "scheduler.max_num_batched_tokens": 128,
        "cache.memory_bytes": 256 << 20,
        "testing.enabled": True,
    }
    if spec:
        base["decode.speculative.method"] = "ngram"
    base.update(overrides)
    return LLMEngine(make_config(**base))


@pytest.fixture(scope="module")
def workload(real_model_dir: Path) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    eng = _engine(real_model_dir, spec=False)
    tok = eng.tokenizer
    prompts = {f"raw{i}": tok.encode(t) for i, t in enumerate(RAW)}
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        prompts[f"chat{i}"] = tok.encode_chat(msgs)
    for i, conv in enumerate(copy_heavy()[::3]):  # prose and code edits
        prompts[f"copy{i}"] = tok.encode_chat(conv)
    assert len(prompts) >= 8 and len({len(p) for p in prompts.values()}) >= 8
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(NUM_NEW)))
    refs = run_until_done(eng)
    eng.check_integrity()
    return prompts, refs


def _run_twice(eng: LLMEngine, prompts: dict[str, list[int]]) -> list[dict[str, list[int]]]:
    rounds = []
    for r in ("a", "b"):
        for rid, p in prompts.items():
            eng.add(EngineRequest(f"{rid}#{r}", p, greedy(NUM_NEW)))
        out = run_until_done(eng)
        eng.check_integrity()
        assert eng.block_manager.num_used_blocks == 0
        rounds.append({rid.split("#")[0]: toks for rid, toks in out.items()})
    return rounds


def test_speculation_is_token_identical_with_chunks_and_prefix_hits(
    real_model_dir: Path, workload: Any
) -> None:
    prompts, refs = workload
    eng = _engine(real_model_dir, spec=True)
    for got in _run_twice(eng, prompts):
        for rid in prompts:
            assert got[rid] == refs[rid], rid
    stats = eng.stats()
    assert stats["num_cached_prompt_tokens"] > 0  # the second round hit the prefix cache
    spec = stats["spec"]
    assert spec["num_accepted_tokens"] > NUM_NEW, spec  # the copy prompts were quoted
    assert stats["num_steps"] < 2 * (NUM_NEW + 20)


def test_speculation_is_token_identical_under_preemption(
    real_model_dir: Path, workload: Any
) -> None:
    prompts, refs = workload
    eng = _engine(real_model_dir, spec=True, **{"testing.force_preempt_interval": 7})
    subset = {k: v for k, v in prompts.items() if k.startswith(("copy", "raw"))}
    for got in _run_twice(eng, subset):
        for rid, toks in got.items():
            assert toks == refs[rid], rid
    assert eng.stats()["num_preemptions"] > 0
    assert eng.stats()["spec"]["num_accepted_tokens"] > 0
