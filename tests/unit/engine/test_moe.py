"""Mixture-of-experts layers (``cluster.engine.models.moe``): grouped by expert, equal to the
per-token definition, loaded from Mixtral and Qwen3-MoE checkpoints (dense and int8 weights),
with the router's load balance in the engine's stats. Exactness against transformers is in
``test_exactness_tiny.py`` (the ``mixtral`` and ``qwen3_moe`` families)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.models.moe import ExpertLoad, ExpertWeights, moe_add
from cluster.engine.models.packed import PackedWeight
from tests.helpers import greedy, run_until_done, tiny_config


class CountingOps:
    """``ops.linear`` that counts how often each weight is read."""

    def __init__(self) -> None:
        self.reads: Counter[int] = Counter()

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        self.reads[id(w)] += 1
        return F.linear(x, w, b)


def _experts(num: int, top_k: int, norm: bool, h: int = 16, inter: int = 8) -> ExpertWeights:
    g = torch.Generator().manual_seed(num * 10 + top_k)
    return ExpertWeights(
        router=torch.randn(num, h, generator=g),
        gate_up=[torch.randn(2 * inter, h, generator=g) * 0.3 for _ in range(num)],
        down=[torch.randn(h, inter, generator=g) * 0.3 for _ in range(num)],
        top_k=top_k,
        norm_topk_prob=norm,
    )


def _per_token(x: torch.Tensor, moe: ExpertWeights) -> torch.Tensor:
    """The definition, one token at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(F.linear(x[t], moe.router), dim=-1)
        w, idx = probs.topk(moe.top_k)
        if moe.norm_topk_prob:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), idx.tolist(), strict=True):
            gu = F.linear(x[t], moe.gate_up[e])
            inter = gu.shape[0] // 2
            out[t] += weight * F.linear(F.silu(gu[:inter]) * gu[inter:], moe.down[e])
    return out


@pytest.mark.parametrize(("num", "top_k", "norm"), [(4, 2, True), (8, 3, False), (3, 1, True)])
def test_grouped_experts_equal_the_per_token_definition_reading_each_expert_once(
    num: int, top_k: int, norm: bool
) -> None:
    moe = _experts(num, top_k, norm)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(7))
    h = torch.randn(37, 16)
    ops, load = CountingOps(), ExpertLoad(num)
    load.start_step()
    got = moe_add(h, x, moe, ops, load)
    torch.testing.assert_close(got, h + _per_token(x, moe), rtol=1e-5, atol=1e-5)
    # each expert's two matrices read once for the whole batch (not once per token)
    assert set(ops.reads.values()) == {1}
    assert len(ops.reads) == 2 * sum(1 for c in load.last.tolist() if c)
    assert int(load.last.sum()) == 37 * top_k
    stats = load.stats()
    assert stats["last_step_imbalance"] >= 1.0 and stats["steps"] == 1


def _moe_model(tmp_path: Path, family: str, **overrides: Any) -> Path:
    from cluster.engine.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path / family, family=family, **overrides)


def test_a_mixtral_engine_reports_its_router_load_balance(tmp_path: Path) -> None:
    model_dir = _moe_model(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    eng = LLMEngine(tiny_config(model_dir, **{"cache.num_blocks": 64}))
    prompts = {f"r{i}": [5 + i + 3 * j for j in range(6 + 5 * i)] for i in range(3)}
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(5)))
    run_until_done(eng)
    eng.check_integrity()
    moe = eng.stats()["moe"]
    fed = sum(len(p) for p in prompts.values()) + 3 * 4  # prompts, then 4 decode tokens each
    assert moe["num_experts"] == 4
    # every token fed goes to 2 experts in each of the 2 layers
    assert sum(moe["total_tokens"]) == fed * 2 * 2
    assert moe["imbalance"] >= 1.0 and len(moe["last_step_tokens"]) == 4
    print("mixtral load balance:", json.dumps(moe))


def test_qwen3_moe_keeps_its_dense_layers_and_int8_quantizes_every_expert(
    tmp_path: Path,
) -> None:
    over = {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "mlp_only_layers": [1],
        "head_dim": 16,
    }
    model_dir = _moe_model(tmp_path, "qwen3_moe", **over)
    dense = LLMEngine(tiny_config(model_dir, **{"cache.num_blocks": 64}))
    layers = dense.runner.model.layers
    assert layers[0].moe is not None and layers[0].gate_up is None
    assert layers[0].moe.num_experts == 6 and not layers[0].moe.norm_topk_prob
    assert layers[1].moe is None and layers[1].gate_up is not None  # mlp_only_layers
    q8 = LLMEngine(tiny_config(model_dir, **{"cache.num_blocks": 64, "model.weights": "int8"}))
    assert all(isinstance(m, PackedWeight) for m in q8.runner.model.matrices())
    # embed, lm_head; layer 0: qkv, o, 6 experts x 2; layer 1: qkv, o, gate_up, down
    assert len(q8.runner.model.matrices()) == 2 + (2 + 2 * 6) + 4
    for eng in (dense, q8):
        eng.add(EngineRequest("a", list(range(3, 40)), greedy(6)))
        assert len(run_until_done(eng)["a"]) == 6
        eng.check_integrity()


def test_an_impossible_top_k_is_refused_naming_it(tmp_path: Path) -> None:
    model_dir = _moe_model(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["num_experts_per_tok"] = 5
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be in 1..4"):
        LLMEngine(tiny_config(model_dir))
