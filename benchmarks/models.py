"""``models`` (issue 37): decode tok/s of every architecture pdserve runs against transformers.

How (docs/benchmarks/index.md, ``models``):
  1. For each architecture a random-weight checkpoint is built from its transformers config
     (``build_tiny_llama``), sized like a ~100M model in full mode (SmolLM-135M's shape: hidden
     576, 30 layers, 9 heads, 3 KV heads, MLP 1536; the mixtures of experts 8 experts of 384,
     top 2), smaller in quick mode, tiny in smoke mode. No download.
  2. Our arm: the engine in the decode role, a batch of 1 and of 32 requests with 128 prompt
     tokens of KV each (``start_batch``, as P6), timed decode steps; tok/s = batch / median step.
  3. transformers' arm: ``generate`` on the same checkpoint (fp32, sdpa), the same batch of
     128-token prompts, greedy, EOS ignored; per-step times from a logits processor (the first,
     the prefill, left out); tok/s = batch / median gap.
  4. Arms in a shuffled order per repetition; the ratio per repetition, median reported.
  5. ``moe_grouped_vs_loop_b32``: one MoE layer of the Mixtral model at 32 tokens, our grouped
     experts (each expert once over all of its tokens) against a per-token loop over each
     token's experts (what a naive implementation does); the loop's time over ours.

Keys: ``<arch>_b32_vs_hf`` (ours over transformers at batch 32, target >= 1.5 for every
architecture), ``moe_grouped_vs_loop_b32`` (>= 3).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import BenchContext, BenchReport, interleaved_order
from benchmarks.hf_reference import generate_exact, load_hf_model
from benchmarks.workloads import make_engine, pin_threads
from cluster.engine.engine import LLMEngine
from cluster.engine.models.moe import ExpertWeights, moe_add
from cluster.planner.measure.engine import random_prompt, start_batch

CONTEXT = 128
BATCHES = (1, 32)
SHAPES = {
    "full": {
        "hidden_size": 576,
        "num_layers": 30,
        "num_heads": 9,
        "num_kv_heads": 3,
        "intermediate_size": 1536,
    },
    "quick": {
        "hidden_size": 256,
        "num_layers": 8,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 704,
    },
    "smoke": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 128,
    },
}


def _families(mode: str) -> dict[str, dict[str, Any]]:
    """Each architecture's config beyond the shared shape."""
    shape = SHAPES[mode]
    head_dim = shape["hidden_size"] // shape["num_heads"]
    expert = max(32, shape["intermediate_size"] // 4)
    return {
        "llama": {},
        "qwen2": {},
        "qwen3": {"head_dim": head_dim},
        "phi3": {},
        "mistral": {"sliding_window": 4096},
        "gemma3": {
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "sliding_window": 1024,
            "layer_types": [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                for i in range(shape["num_layers"])
            ],
        },
        "mixtral": {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": expert,
        },
        "qwen3_moe": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": expert,
            "norm_topk_prob": True,
            "head_dim": head_dim,
        },
    }


class StepClock:
    """A logits processor that only notes when each generate step reached it."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _hf_tok_s(model: Any, prompts: list[list[int]], num_steps: int) -> float:
    from transformers import LogitsProcessorList

    clock = StepClock()
    pad = model.config.eos_token_id
    ids = torch.tensor(prompts, dtype=torch.long)
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_steps,
        min_new_tokens=num_steps,
        pad_token_id=pad[0] if isinstance(pad, list) else pad,
        logits_processor=LogitsProcessorList([clock]),
    )
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return len(prompts) / statistics.median(gaps)


def _ours_tok_s(engine: LLMEngine, rng: random.Random, batch: int, num_steps: int) -> float:
    rids = start_batch(engine, rng, f"b{batch}-{rng.random()}", batch, CONTEXT, num_steps + 4)
    engine.step()  # admits the batch
    steps = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t0)
        assert len(outputs) == batch, f"expected a {batch}-wide decode step"
    for rid in rids:
        engine.abort_request(rid)
    engine.step()
    return batch / statistics.median(steps)


def _per_token_loop(h: torch.Tensor, x: torch.Tensor, moe: ExpertWeights) -> torch.Tensor:
    """The naive baseline: each token, each of its experts, one row at a time."""
    probs = torch.softmax(F.linear(x, moe.router), dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = int(chosen[t, j])
            gu = F.linear(x[t : t + 1], moe.gate_up[e])  # type: ignore[arg-type]
            inter = gu.shape[1] // 2
            y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], moe.down[e])  # type: ignore[arg-type]
            out[t] += weights[t, j] * y[0]
    return h + out


def _moe_ratio(engine: LLMEngine, reps: int) -> float:
    """Per-token loop time over grouped time, one MoE layer at 32 tokens (medians)."""
    model = engine.runner.model  # type: ignore[attr-defined]
    moe = next(lw.moe for lw in model.layers if lw.moe is not None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, model.arch.hidden_size, generator=g)
    h = torch.zeros_like(x)
    ops = model.ops
    grouped: list[float] = []
    loop: list[float] = []
    with torch.inference_mode():
        for rep in range(reps):
            for arm in interleaved_order(("grouped", "loop"), rep):
                t0 = time.perf_counter()
                if arm == "grouped":
                    moe_add(h, x, moe, ops, None)
                else:
                    _per_token_loop(h, x, moe)
                (grouped if arm == "grouped" else loop).append(time.perf_counter() - t0)
    return statistics.median(loop) / statistics.median(grouped)


def run(ctx: BenchContext) -> BenchReport:
    from cluster.engine.models.tiny import build_tiny_llama

    reps = ctx.pick(3, 2, 1)
    num_steps = ctx.pick(16, 8, 3)
    threads = pin_threads(ctx)
    rng = random.Random(0)
    keys: dict[str, float] = {}
    table: list[dict[str, Any]] = []
    details: dict[str, Any] = {"threads": threads, "shape": SHAPES[ctx.mode], "context": CONTEXT}
    blocks = 32 * (-(-(CONTEXT + num_steps + 8) // 16)) + 16
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-models-") as tmp:
        for family, extra in _families(ctx.mode).items():
            ctx.progress(f"{family}: building a random-weight checkpoint")
            shape = {**SHAPES[ctx.mode], **extra}
            model_dir = build_tiny_llama(Path(tmp) / family, family=family, **shape)
            overrides = {"model.path": str(model_dir), "cache.num_blocks": blocks}
            engine = make_engine(ctx, overrides, role="decode")
            hf = load_hf_model(model_dir)
            pin_threads(ctx)
            ours: dict[int, list[float]] = {b: [] for b in BATCHES}
            theirs: dict[int, list[float]] = {b: [] for b in BATCHES}
            with torch.inference_mode():
                generate_exact(hf, [random_prompt(rng, 16, engine.vocab_size)], 2)  # warm up
            for rep in range(reps):
                for arm in interleaved_order(("ours", "hf"), rep):
                    for b in BATCHES:
                        if arm == "ours":
                            ours[b].append(_ours_tok_s(engine, rng, b, num_steps))
                        else:
                            prompts = [
                                random_prompt(rng, CONTEXT, engine.vocab_size) for _ in range(b)
                            ]
                            theirs[b].append(_hf_tok_s(hf, prompts, num_steps + 1))
            engine.check_integrity()
            ratio = statistics.median(a / t for a, t in zip(ours[32], theirs[32], strict=True))
            keys[f"{family}_b32_vs_hf"] = ratio
            for b in BATCHES:
                table.append(
                    {
                        "arch": family,
                        "batch": b,
                        "ours_tok_s": statistics.median(ours[b]),
                        "hf_tok_s": statistics.median(theirs[b]),
                    }
                )
            ctx.progress(f"{family}: b32 {ratio:.2f}x transformers")
            if family == "mixtral":
                keys["moe_grouped_vs_loop_b32"] = _moe_ratio(engine, ctx.pick(9, 5, 2))
            details[family] = {"ours": ours, "hf": theirs}
            del engine, hf
    targets = {k: ">= 1.5" for k in keys if k.endswith("_vs_hf")}
    targets["moe_grouped_vs_loop_b32"] = ">= 3"
    return BenchReport(keys=keys, table=table, details=details, targets=targets)
