"""Token sampling. Randomness is a function of (request seed, output index) only.

So a request split across a prefill and a decode replica, or recomputed after preemption,
draws exactly the same tokens: each draw seeds its own generator from the pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cluster.common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, output_index: int) -> int:
    """splitmix64 of the pair: well-mixed, cheap, identical in every process."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs of one row."""

    params: SamplingParams
    seed: int
    output_index: int  # index of the token being drawn among the request's outputs
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    suppress_token_ids: tuple[int, ...]  # EOS/stop ids while below min_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # the chosen token's log-probability under the model
    top_logprobs: list[list[tuple[int, float]]] | None


def sample(logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
    """logits: [S, V] float32, one row per entry of ``rows``."""
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    needs_processing = any(
        r.suppress_token_ids
        or r.params.has_penalties
        or r.params.logit_bias
        or not r.params.is_greedy
        for r in rows
    )
    if not needs_processing:
        token_ids = argmax_rows(logits)
    else:
        token_ids = [_sample_row(logits[i], r) for i, r in enumerate(rows)]
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    picked = raw_logprobs.gather(1, chosen.view(-1, 1)).view(-1).tolist()
    logprobs = [lp if r.params.logprobs is not None else 0.0 for lp, r in zip(picked, rows)]
    k_max = max(r.params.logprobs or 0 for r in rows)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if k_max:
        vals, ids = raw_logprobs.topk(k_max, dim=-1)
        for i, r in enumerate(rows):
            k = r.params.logprobs or 0
            top[i] = list(zip(ids[i, :k].tolist(), vals[i, :k].tolist()))
    return SamplerOutput(token_ids, logprobs, top)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value (the first of equal ones; NaN counts as largest).

    On the CPU through numpy, whose argmax over a vocabulary row costs a fraction of torch's
    (figures: docs/design/decisions.md, "Small fixed costs of a decode step").
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return np.argmax(logits.detach().numpy(), axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _sample_row(row: torch.Tensor, r: SampleRequest) -> int:
    """row: [V] float32 logits (left as they are: a row to change is copied first)."""
    p = r.params
    if p.is_greedy and not p.logit_bias and not p.has_penalties:
        # only ids to suppress (EOS below min_tokens): they matter when one of them wins
        (top,) = argmax_rows(row.unsqueeze(0))
        if top not in r.suppress_token_ids:
            return top
    row = row.clone()
    if r.suppress_token_ids:
        row[list(r.suppress_token_ids)] = float("-inf")
    if p.logit_bias:  # OpenAI: added to the logits before sampling (greedy included)
        ids, biases = zip(*p.logit_bias, strict=True)
        row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if p.has_penalties:
        _apply_penalties(row, r)
    if p.is_greedy:
        return argmax_rows(row.unsqueeze(0))[0]
    row.div_(p.temperature)
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row.masked_fill_(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = (cum - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, with a seeded generator.
    gen = torch.Generator(device=row.device).manual_seed(draw_seed(r.seed, r.output_index))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return argmax_rows((probs / noise).unsqueeze(0))[0]


def _apply_penalties(row: torch.Tensor, r: SampleRequest) -> None:
    p = r.params
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
            dtype=torch.long,
            device=device,
        )
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
