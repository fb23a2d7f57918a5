"""Mixture-of-experts feed-forward layers (Mixtral, Qwen3-MoE), run grouped by expert.

A layer's router scores every token against the experts (softmax over all of them), keeps the
top k per token (Mixtral, and Qwen3-MoE with ``norm_topk_prob``, renormalize the k weights to
sum to 1), and each token's output is the weighted sum of its k experts' SwiGLU MLPs. The step
runs each expert once over all of its tokens in the batch (its weights read once per step,
whatever the number of its tokens), experts in ascending order, each output added into its
tokens' rows: the numerics of transformers' own loop, so greedy outputs match it (fp32).

``ExpertLoad`` counts the tokens routed to each expert in the last step (summed over the MoE
layers) and in all: the engine's stats report the load balance from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from cluster.engine.models.packed import Weight


@dataclass
class ExpertWeights:
    router: torch.Tensor  # [E, H], dense (a few rows: scores for every token)
    gate_up: list[Weight]  # per expert [2 * I, H]
    down: list[Weight]  # per expert [H, I]
    top_k: int
    norm_topk_prob: bool

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def matrices(self) -> list[Weight]:
        return [*self.gate_up, *self.down]


@dataclass
class ExpertLoad:
    """Tokens per expert, summed over the MoE layers: the last step's and since the start."""

    num_experts: int
    last: torch.Tensor = field(init=False)
    total: torch.Tensor = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        self.last = torch.zeros(self.num_experts, dtype=torch.int64)
        self.total = torch.zeros(self.num_experts, dtype=torch.int64)

    def start_step(self) -> None:
        self.last.zero_()
        self.steps += 1

    def add(self, counts: torch.Tensor) -> None:
        """(On the counts' device: no host sync per layer; ``stats`` reads them back.)"""
        if self.last.device != counts.device:
            self.last, self.total = self.last.to(counts.device), self.total.to(counts.device)
        self.last += counts
        self.total += counts

    def stats(self) -> dict[str, Any]:
        """Per expert tokens; imbalance = the busiest expert's share over an even one's (1.0 is
        perfectly balanced), for the last step and overall."""
        return {
            "num_experts": self.num_experts,
            "steps": self.steps,
            "last_step_tokens": self.last.tolist(),
            "last_step_imbalance": _imbalance(self.last),
            "total_tokens": self.total.tolist(),
            "imbalance": _imbalance(self.total),
        }


def _imbalance(counts: torch.Tensor) -> float:
    total = int(counts.sum())
    return float(counts.max()) * len(counts) / total if total else 0.0


def moe_add(
    h: torch.Tensor, x: torch.Tensor, moe: ExpertWeights, ops: Any, load: ExpertLoad | None
) -> torch.Tensor:
    """``h`` + the experts' weighted outputs for the normalized rows ``x`` ([N, H])."""
    logits = F.linear(x, moe.router)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, moe.top_k, dim=-1)  # [N, k]
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    flat = chosen.flatten()  # [N * k]: token t's j-th expert at t * k + j
    counts = torch.bincount(flat, minlength=moe.num_experts)
    # The (token, slot) pairs sorted by expert, tokens in order within each: one gather of the
    # rows, then each expert a contiguous run of them.
    order = torch.argsort(flat, stable=True)
    rows = order // moe.top_k
    picked = x[rows]  # [N * k, H]
    scale = weights.flatten()[order, None]  # [N * k, 1]
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if not n:
            continue
        run = slice(start, start + n)
        start += n
        gu = ops.linear(picked[run], moe.gate_up[e], None)  # [n_e, 2I]
        inter = gu.shape[1] // 2
        y = ops.linear(F.silu(gu[:, :inter]) * gu[:, inter:], moe.down[e], None)  # [n_e, H]
        out.index_add_(0, rows[run], y * scale[run])
    if load is not None:
        load.add(counts)
    return h + out
