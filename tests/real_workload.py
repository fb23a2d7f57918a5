"""The real model's greedy workload and its transformers references, computed once per session.

Nine prompts of different lengths (five raw texts; four chats sharing a long system prompt, for
prefix-cache hits), each with the reference's 64 greedy tokens and their logits, from
transformers on the fp32 checkpoint (one left-padded batch: ``hf_greedy_batch``, checked against
the batch-1 loop in tests/unit/engine/test_exactness_tiny.py), before any engine runs. The
exactness tests and the GGUF-weights test judge their engines against the same references (the
``real_workload`` session fixture in tests/conftest.py), so transformers runs them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.reference import Reference, hf_greedy_batch, load_hf

NUM_NEW = 64
SYSTEM = (
    "You are a careful assistant for a company that builds serving systems for large language "
    "models. Answer briefly, cite the relevant component, and never invent numbers. The system "
    "has a router, a prefill pool, a decode pool and a KV transfer layer between them."
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain what a KV cache is.",
    "List three prime numbers.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a kingdom by the sea, there lived a princess who",
    "1, 1, 2, 3, 5, 8, 13,",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


@dataclass(frozen=True)
class RealWorkload:
    prompts: dict[str, list[int]]
    refs: dict[str, Reference]


def build_real_workload(real_model_dir: Path) -> RealWorkload:
    from cluster.common.tokenizer import Tokenizer

    tok = Tokenizer(real_model_dir)
    prompts: dict[str, list[int]] = {}
    for i, text in enumerate(RAW):
        prompts[f"raw{i}"] = tok.encode(text)
    for i, q in enumerate(QUESTIONS):  # share the long system prompt: prefix-cache hits
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        prompts[f"chat{i}"] = tok.encode_chat(msgs)
    hf = load_hf(real_model_dir)
    batch = hf_greedy_batch(hf, list(prompts.values()), NUM_NEW, tok.eos_token_ids)
    refs = dict(zip(prompts, batch, strict=True))
    del hf
    return RealWorkload(prompts, refs)
