"""Prompt logprobs (``SamplingParams.prompt_logprobs = k``): the log-softmax of the logits at
every prompt position, for OpenAI's completions with ``echo`` and ``logprobs``.

Position ``p``'s logits predict prompt token ``p + 1``: its entry is that token's logprob and
the top k, for ``p`` in ``[0, P - 1)`` (the last position's logits give the first output; the
first prompt token has no entry: a client shows it as null). They are computed in the prefill
forward for the positions each step computes (chunks: a slice per step), so:

* the prefix cache is skipped for such requests (``Scheduler._admit``; vLLM does the same): a
  cached block's positions were never run through this request's forward, and keeping their
  logits would cost far more than recomputing a prompt whose logprobs were asked for;
* a preempted request recomputes its prompt and its entries again (a slice from ``start`` on
  replaces what was there);
* in PD they are computed where the prompt is prefilled, and such requests prefill on the
  decode replica (``DecodeHandoff.admit``), which streams them to the router with the first
  token: the prefill reply then carries nothing new, and a prompt whose every position's
  logits are wanted gains little from disaggregation.

Runners call ``positions`` (which rows of a step's forward to score) and ``score`` (the entries
from those rows' logits); the engine ``record``s them on the request, and the first output of
the request's sample 0 carries them (``RequestOutput.prompt_logprobs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cluster.engine.batch import ScheduledRequest
from cluster.engine.request import Request

# (logprob of the prompt token, its top k (token id, logprob)); None for the first token
PromptLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class PromptRows:
    """One request's positions scored in a step: ``start`` .. ``start + len(targets)``."""

    request_id: str
    start: int  # first position scored (its logits predict prompt token start + 1)
    targets: list[int]  # the prompt tokens those positions predict
    k: int


def positions(item: ScheduledRequest) -> PromptRows | None:
    """The positions of ``item``'s step whose logits score a prompt token (None: no entries)."""
    r = item.request
    k = r.params.prompt_logprobs
    start = r.num_computed_tokens
    end = min(start + item.num_new_tokens, r.num_prompt_tokens - 1)
    if k is None or start >= end:
        return None
    return PromptRows(r.request_id, start, r.prompt_token_ids[start + 1 : end + 1], k)


def score(logits: torch.Tensor, rows: Sequence[PromptRows]) -> dict[str, tuple[int, list]]:
    """logits: [sum of len(targets), V] fp32, each request's rows in order -> per request
    ``(start, entries)``."""
    out: dict[str, tuple[int, list]] = {}
    if not rows:
        return out
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([t for r in rows for t in r.targets], device=logits.device)
    picked = logprobs.gather(1, targets.view(-1, 1)).view(-1).tolist()
    k_max = max(r.k for r in rows)
    vals, ids = logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], logprobs[:, :0])
    row = 0
    for r in rows:
        entries: list[PromptLogprob] = []
        for j in range(len(r.targets)):
            top = list(zip(ids[row + j, : r.k].tolist(), vals[row + j, : r.k].tolist()))
            entries.append((picked[row + j], top))
        row += len(r.targets)
        out[r.request_id] = (r.start, entries)
    return out


def record(requests: Mapping[str, Request], scored: Mapping[str, tuple[int, list]]) -> None:
    """Keep a step's entries on their requests (a recomputed slice replaces the old one)."""
    for rid, (start, entries) in scored.items():
        kept = requests[rid].prompt_logprobs
        del kept[start:]
        kept.extend(entries)
