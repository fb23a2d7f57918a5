"""The device sampler: greedy is the argmax, seeded draws are a function of (seed, output index)
alone, the filters never let an excluded token through, and the draws follow the softmax."""

from __future__ import annotations

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.gpu.device_sampler import (
    DeviceSamplingParams,
    draw_seeds,
    filtered_probs,
    sample_on_device,
    supported,
)
from cluster.engine.sampler import SampleRequest, draw_seed

pytestmark = pytest.mark.timeout(60)

V = 50


def _rows(
    params: list[SamplingParams], seeds: list[int], indices: list[int]
) -> list[SampleRequest]:
    return [
        SampleRequest(p, s, i, [], [], ()) for p, s, i in zip(params, seeds, indices, strict=True)
    ]


def _logits(b: int, seed: int = 0, v: int = V) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_draw_seeds_equal_the_host_splitmix() -> None:
    g = torch.Generator().manual_seed(1)
    seeds = [0, 1, 2**63 - 1, 2**62 + 12345, *torch.randint(0, 2**62, (20,), generator=g).tolist()]
    indices = [0, 7, 3, 1 << 20, *range(20)]
    got = draw_seeds(torch.tensor(seeds), torch.tensor(indices)).tolist()
    assert got == [draw_seed(s, i) for s, i in zip(seeds, indices)]


def test_greedy_is_the_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1)] * 3
    rows = _rows(params, list(range(6)), [0] * 6)
    out = sample_on_device(logits, DeviceSamplingParams.of(rows, logits.device))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_a_rows_draw_depends_on_its_seed_and_index_only() -> None:
    """The same (seed, index) gives the same token across calls, batch sizes, orders and
    neighbours with other parameters; another index draws afresh."""
    base = _logits(1, seed=2)
    logits = base.expand(8, V).clone()
    p = SamplingParams(temperature=1.0)
    rows = _rows([p] * 8, [5, 5, 9, 9, 5, 9, 7, 7], [0, 1, 0, 1, 2, 2, 0, 1])
    dev = logits.device
    full = sample_on_device(logits, DeviceSamplingParams.of(rows, dev)).token_ids.tolist()
    again = sample_on_device(logits, DeviceSamplingParams.of(rows, dev)).token_ids.tolist()
    assert full == again
    order = [6, 3, 0, 5]
    mixed = _rows(
        [p, SamplingParams(temperature=0.0), p, SamplingParams(top_p=0.5), p], [0] * 5, [0] * 5
    )
    for j, i in enumerate(order):  # the rows in another batch, between other rows
        mixed.insert(2 * j + 1, rows[i])
    sub = base.expand(len(mixed), V).clone()
    got = sample_on_device(sub, DeviceSamplingParams.of(mixed, dev)).token_ids.tolist()
    assert [got[2 * j + 1] for j in range(len(order))] == [full[i] for i in order]
    many = _rows([p] * 64, [5] * 64, list(range(64)))
    draws = sample_on_device(logits[:1].expand(64, V), DeviceSamplingParams.of(many, dev))
    assert len(set(draws.token_ids.tolist())) > 5  # the index does change the draw


def _reference_allowed(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens the host sampler's filters keep for one row (sampler.py's own steps)."""
    x = row / p.temperature
    if 0 < p.top_k < x.shape[0]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, order = probs.sort(descending=True)
        drop = (sp.cumsum(0) - sp) >= p.top_p
        sp[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sp)
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    return set(torch.nonzero(probs > 0).view(-1).tolist())


FILTERS = [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.5, top_p=0.3),
]


def test_filters_never_pick_an_excluded_token() -> None:
    logits = _logits(len(FILTERS), seed=3)
    draws = 200
    big = logits.repeat_interleave(draws, dim=0)
    params = [p for p in FILTERS for _ in range(draws)]
    rows = _rows(params, [11] * len(params), list(range(len(params))))
    dp = DeviceSamplingParams.of(rows, big.device)
    tokens = sample_on_device(big, dp).token_ids.view(len(FILTERS), draws)
    probs = filtered_probs(big, dp).view(len(FILTERS), draws, V)
    for i, p in enumerate(FILTERS):
        allowed = _reference_allowed(logits[i], p)
        assert set(torch.nonzero(probs[i, 0] > 0).view(-1).tolist()) == allowed, p
        picked = set(tokens[i].tolist())
        assert picked <= allowed, p
        assert len(picked) > 1 or len(allowed) == 1


def test_allowed_mask_binds_greedy_and_sampled_rows() -> None:
    logits = _logits(2, seed=4)
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[:, 10:13] = True
    rows = _rows([SamplingParams(temperature=0.0), SamplingParams()], [1, 1], [0, 0])
    out = sample_on_device(logits, DeviceSamplingParams.of(rows, logits.device), allowed=allowed)
    assert all(10 <= t < 13 for t in out.token_ids.tolist())
    assert out.token_ids[0] == 10 + logits[0, 10:13].argmax()


def test_draws_follow_the_softmax() -> None:
    """20000 draws from one 8-token row at temperature 1: each frequency within 0.015 of its
    probability (about 4 standard deviations) and a chi-square statistic below 24 (7 degrees of
    freedom: p < 0.001). Fixed seeds, so the outcome is the same on every run."""
    n, v = 20000, 8
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    rows = _rows([SamplingParams()] * n, [42] * n, list(range(n)))
    logits = row.expand(n, v).contiguous()
    tokens = sample_on_device(logits, DeviceSamplingParams.of(rows, logits.device)).token_ids
    freq = torch.bincount(tokens, minlength=v).double() / n
    expected = torch.softmax(row.double(), dim=0)
    assert (freq - expected).abs().max().item() < 0.015
    chi2 = (n * (freq - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.0, chi2


def test_logprobs_are_gathered_on_the_device() -> None:
    logits = _logits(3, seed=5)
    rows = _rows(
        [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=4)],
        [1, 2, 3],
        [0, 0, 0],
    )
    out = sample_on_device(logits, DeviceSamplingParams.of(rows, logits.device), num_top_logprobs=4)
    ids, lps, tops = out.to_host()
    ref = torch.log_softmax(logits, dim=-1)
    assert lps == pytest.approx([ref[i, t].item() for i, t in enumerate(ids)], abs=1e-6)
    vals, top_ids = ref.topk(4, dim=-1)
    assert [[t for t, _ in row] for row in tops] == top_ids.tolist()
    got = torch.tensor([[lp for _, lp in row] for row in tops])
    torch.testing.assert_close(got, vals, atol=1e-6, rtol=0)


def test_rows_the_host_sampler_keeps() -> None:
    assert supported(_rows([SamplingParams(top_p=0.5)], [0], [0])[0])
    assert not supported(_rows([SamplingParams(presence_penalty=0.5)], [0], [0])[0])
    assert not supported(_rows([SamplingParams(logit_bias=((1, 2.0),))], [0], [0])[0])
    assert not supported(SampleRequest(SamplingParams(), 0, 0, [], [], (3,)))


@pytest.mark.gpu
def test_cuda_draws_equal_cpu_draws() -> None:
    """The counter-based noise is the same on CUDA (the rows' tokens, from the same logits)."""
    logits = _logits(16, seed=6)
    rows = _rows([SamplingParams(temperature=0.8, top_p=0.9)] * 16, [3] * 16, list(range(16)))
    cpu = sample_on_device(logits, DeviceSamplingParams.of(rows, logits.device)).token_ids
    dev = torch.device("cuda")
    gpu = sample_on_device(logits.to(dev), DeviceSamplingParams.of(rows, dev)).token_ids
    assert gpu.cpu().tolist() == cpu.tolist()
