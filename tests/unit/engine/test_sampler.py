"""Sampling: seeded draws depend only on (seed, output index); processors do what they say."""

from __future__ import annotations

import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.sampler import SampleRequest, argmax_rows, draw_seed, sample


def _row(
    params: SamplingParams, seed: int = 1, index: int = 0, outputs=(), suppress=()
) -> SampleRequest:
    return SampleRequest(params, seed, index, [5, 6], list(outputs), tuple(suppress))


def _logits(v: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g) * 3


def test_seeded_draws_ignore_batch_composition() -> None:
    p = SamplingParams(temperature=1.0, seed=3)
    lg = _logits()
    alone = sample(lg.view(1, -1), [_row(p, 3, 4)]).token_ids[0]
    batch = torch.stack([_logits(seed=9), lg, _logits(seed=11)])
    rows = [_row(SamplingParams(temperature=0.7), 1, 0), _row(p, 3, 4), _row(p, 8, 2)]
    assert sample(batch, rows).token_ids[1] == alone
    flat = (lg / 6).view(1, -1)
    draws = {sample(flat, [_row(p, 3, i)]).token_ids[0] for i in range(30)}
    assert len(draws) > 5  # different output indices draw differently
    assert draw_seed(3, 4) == draw_seed(3, 4) != draw_seed(3, 5)


def test_greedy_topk1_and_tiny_top_p_pick_the_argmax() -> None:
    lg = _logits()
    best = int(lg.argmax())
    for p in (
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ):
        assert sample(lg.view(1, -1), [_row(p)]).token_ids == [best]


def test_top_k_and_min_p_restrict_the_support() -> None:
    lg = _logits()
    top5 = set(lg.topk(5).indices.tolist())
    p = SamplingParams(temperature=1.0, top_k=5)
    assert all(sample(lg.view(1, -1), [_row(p, s)]).token_ids[0] in top5 for s in range(40))
    probs = torch.softmax(lg, -1)
    allowed = set((probs >= 0.5 * probs.max()).nonzero().view(-1).tolist())
    p = SamplingParams(temperature=1.0, min_p=0.5)
    assert all(sample(lg.view(1, -1), [_row(p, s)]).token_ids[0] in allowed for s in range(40))


def test_penalties_and_suppression_change_the_choice() -> None:
    lg = torch.zeros(10)
    lg[3], lg[4] = 5.0, 4.0
    rep = SamplingParams(temperature=0, frequency_penalty=2.0)
    assert sample(lg.view(1, -1), [_row(rep, outputs=[3])]).token_ids == [4]
    assert sample(
        lg.view(1, -1), [_row(SamplingParams(temperature=0), suppress=[3])]
    ).token_ids == [4]
    neg = torch.full((10,), -1.0)
    neg[5] = 2.0  # token 5 is in the prompt: repetition penalty divides its positive logit
    neg[7] = 1.5
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(neg.view(1, -1), [_row(p)]).token_ids == [7]


def test_logprobs_are_the_models_log_softmax() -> None:
    lg = _logits()
    out = sample(lg.view(1, -1), [_row(SamplingParams(temperature=0, logprobs=3))])
    ref = torch.log_softmax(lg, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert abs(out.logprobs[0] - float(ref.max())) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == ref.topk(3).indices.tolist()


def test_argmax_rows_is_torch_argmax_first_of_ties_and_nan() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=g)
    x[1, 7] = x[1, 200] = 99.0  # a tie: the first
    x[2, 50] = float("nan")  # NaN counts as the largest
    x[3] = 0.0
    assert argmax_rows(x) == x.argmax(dim=-1).tolist() == argmax_rows(x.double())
    assert argmax_rows(x)[1:4] == [7, 50, 0]
    row = x[4]
    expanded = row.unsqueeze(0).expand(3, -1)  # verify.py samples one row for several requests
    assert argmax_rows(expanded) == [int(row.argmax())] * 3


def test_a_greedy_row_with_suppressed_ids_leaves_the_callers_logits_alone() -> None:
    lg = torch.zeros(1, 10)
    lg[0, 3], lg[0, 4] = 5.0, 4.0
    before = lg.clone()
    p = SamplingParams(temperature=0)
    assert sample(lg, [_row(p, suppress=(3,))]).token_ids == [4]  # the winner suppressed
    assert sample(lg, [_row(p, suppress=(7,))]).token_ids == [3]  # a loser suppressed
    assert torch.equal(lg, before)
