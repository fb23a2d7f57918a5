"""Sampling a step's rows and verifying drafts: ``sample_and_verify(logits, items)``.

Every runner ends its step here. A plain item has one sampled row; an item with drafts
``d1..dk`` has ``1 + k``: row ``j`` holds the logits after the request's last token and
``d1..dj``, for output index ``n + j``. Row ``j`` is sampled exactly as it would be without
speculation at that index (its processing counts ``d1..dj`` as output: penalties, min_tokens),
with the randomness of (seed, ``n + j``); ``d(j+1)`` is accepted when it equals that sample.
The first mismatch is replaced by the sample (the correction); when every draft is accepted the
last row gives one more (the bonus). Rows after a rejection are never sampled.

Exactness. Greedy: the argmax chain, token-identical to decoding without drafts. Sampled: the
sample at each index is an exponential race (``sampler``) over the processed distribution p,
so a draft d is accepted with probability p(d), and on rejection the emitted token is a draw
from p with d removed and renormalised: the standard rejection rule for a deterministic
proposer, with the uniform draws coupled to (seed, index). So the emitted distribution is p
at every index, and the same seed reproduces the same tokens with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cluster.engine.batch import ScheduledRequest, TokenMasks
from cluster.engine.request import Request
from cluster.engine.runner import RunnerOutput
from cluster.engine.sampler import SampleRequest, SamplerOutput, sample

# (logits [S, V], one request per row) -> the rows' tokens: ``sampler.sample``, or on CUDA
# ``gpu.device_sampler.sample_rows`` (the same contract, its own random stream)
Sampler = Callable[[torch.Tensor, list[SampleRequest]], SamplerOutput]


def sample_request(item: ScheduledRequest, row: int = 0) -> SampleRequest:
    """What the sampler needs of ``item``'s sampled row ``row`` (0: the last known token's)."""
    r = item.request
    p = r.params
    index = r.num_output_tokens + row
    outputs = r.output_token_ids if row == 0 else r.output_token_ids + item.draft_token_ids[:row]
    suppress: tuple[int, ...] = ()
    if index < p.min_tokens:
        suppress = tuple(set(r.eos_token_ids) | set(p.stop_token_ids))
    return SampleRequest(
        params=p,
        seed=r.seed,
        output_index=index,
        prompt_token_ids=r.prompt_token_ids,
        output_token_ids=outputs,
        suppress_token_ids=suppress,
    )


def sample_and_verify(
    logits: torch.Tensor,
    items: Sequence[ScheduledRequest],
    masks: TokenMasks | None = None,
    sampler: Sampler = sample,
) -> RunnerOutput:
    """logits: [sum of items' num_sampled_rows, V] fp32, each item's rows in order; ``masks``:
    grammar masks of constrained rows (structured output), applied before anything is sampled;
    ``sampler``: what draws each round's rows.

    Returns one entry per emitted token (``RunnerOutput``): per item its accepted drafts, then
    the correction or bonus token; an item without drafts emits exactly one.
    """
    first_row: list[int] = []
    num_rows = 0
    for it in items:
        first_row.append(num_rows)
        num_rows += 1 + len(it.draft_token_ids)
    assert num_rows == logits.shape[0], (num_rows, tuple(logits.shape))
    if masks is not None:
        logits = masks.apply(logits, items)
    emitted: list[list[tuple[int, float, list[tuple[int, float]]]]] = [[] for _ in items]
    want_logprobs = any(it.request.params.logprobs is not None for it in items)
    live = list(range(len(items)))  # items whose rows so far all matched their drafts
    j = 0
    while live:
        rows = [first_row[i] + j for i in live]
        step_logits = logits if rows == list(range(num_rows)) else logits[rows]
        out = sampler(step_logits, [sample_request(items[i], j) for i in live])
        still: list[int] = []
        for pos, i in enumerate(live):
            token = out.token_ids[pos]
            lp = out.logprobs[pos] if out.logprobs is not None else 0.0
            top = out.top_logprobs[pos] if out.top_logprobs is not None else []
            emitted[i].append((token, lp, top))
            drafts = items[i].draft_token_ids
            if j < len(drafts) and token == drafts[j]:
                still.append(i)
        live = still
        j += 1
    result = RunnerOutput([], [], [] if want_logprobs else None, [] if want_logprobs else None)
    for i, (it, tokens) in enumerate(zip(items, emitted, strict=True)):
        if it.fanout:  # its samples' first tokens, before its own (``parallel``)
            _fan_out(logits[first_row[i]], it.fanout, result, sampler)
        for token, lp, top in tokens:
            result.request_ids.append(it.request.request_id)
            result.token_ids.append(token)
            if result.logprobs is not None and result.top_logprobs is not None:
                result.logprobs.append(lp)
                result.top_logprobs.append(top)
    return result


def _fan_out(
    row: torch.Tensor, samples: Sequence[Request], result: RunnerOutput, sampler: Sampler = sample
) -> None:
    """Each sample's first token from its leader's last prompt row (masked already), drawn
    with the sample's own seed: what a request of its own would draw from the same logits."""
    rows = [sample_request(ScheduledRequest(s, 0, [])) for s in samples]
    out = sampler(row.unsqueeze(0).expand(len(rows), -1), rows)
    for k, s in enumerate(samples):
        result.request_ids.append(s.request_id)
        result.token_ids.append(out.token_ids[k])
        if result.logprobs is not None and result.top_logprobs is not None:
            result.logprobs.append(out.logprobs[k] if out.logprobs is not None else 0.0)
            result.top_logprobs.append(out.top_logprobs[k] if out.top_logprobs is not None else [])
