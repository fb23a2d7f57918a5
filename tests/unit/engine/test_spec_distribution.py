"""Distribution exactness of speculative sampling (temperature > 0).

A draft is accepted with probability p(d), a rejection emits a draw from p without d, and so
every emitted token is distributed as p. Checked with Pearson's chi-square at p > 0.01 over
>= 20k samples, for a proposer that is right (the mode), wrong (a token of ~0 probability) and
half right:
  * through the engine, on the fake runner, whose next-token distribution is known: a token m
    above the fake model's base has probability proportional to exp(-m / temperature);
  * on ``sample_and_verify`` directly, for a processed distribution (top-k, top-p, min-p,
    penalties that count the draft before the second position).
"""

from __future__ import annotations

import math

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.batch import ScheduledRequest
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.request import Request
from cluster.engine.sampler import SampleRequest, _apply_penalties, _sample_row, draw_seed
from cluster.engine.spec.verify import sample_and_verify
from tests.helpers import fake_config, run_until_done
from tests.spec_helpers import FakeModeProposer, chi_square_p, fake_bases, use_proposer

NUM_SAMPLES = 20_000
MIN_P_VALUE = 0.01
NUM_BINS = 7  # offsets 0..5 and ">= 6": an even number of degrees of freedom


def _geometric_bins(temperature: float, vocab: int) -> list[float]:
    w = [math.exp(-m / temperature) for m in range(vocab)]
    total = sum(w)
    probs = [x / total for x in w[: NUM_BINS - 1]]
    return [*probs, 1.0 - sum(probs)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["right", "wrong", "half"])
def test_engine_emits_the_target_distribution(mode: str) -> None:
    num_tokens = 160  # x 128 requests: 20,480 emitted tokens
    cfg = fake_config(
        **{
            "decode.speculative.method": "ngram",
            "decode.speculative.num_speculative_tokens": 4,
            "decode.speculative.min_acceptance_rate": 0.0,  # never pause: verify every step
            "decode.speculative.draft_row_cost": 0.0,
            "decode.speculative.measure_row_cost": False,
            "decode.speculative.max_batch_size": 64,
            "scheduler.max_num_seqs": 64,
            "scheduler.max_num_batched_tokens": 2048,
            "cache.num_blocks": 1024,
        }
    )
    eng = LLMEngine(cfg)
    runner = eng.runner
    use_proposer(eng, FakeModeProposer(runner, mode, k=4))  # type: ignore[arg-type]
    outcomes: list[tuple[int, int]] = []  # (drafted, accepted) per verification
    record = eng.speculator.record

    def recording(item: ScheduledRequest, num_accepted: int) -> None:
        if item.draft_token_ids:
            outcomes.append((len(item.draft_token_ids), num_accepted))
        record(item, num_accepted)

    eng.speculator.record = recording  # type: ignore[method-assign]
    prompts = {f"r{i}": [1 + (i * 29 + j * 13) % 500 for j in range(6 + i % 9)] for i in range(128)}
    for i, (rid, p) in enumerate(prompts.items()):
        params = SamplingParams(temperature=1.0, max_tokens=num_tokens, ignore_eos=True, seed=i)
        eng.add(EngineRequest(rid, p, params))
    out = run_until_done(eng)
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    counts = [0] * NUM_BINS
    for rid, tokens in out.items():
        assert len(tokens) == num_tokens
        bases = fake_bases(runner, prompts[rid] + tokens)  # type: ignore[arg-type]
        n = len(prompts[rid])
        for i, t in enumerate(tokens):
            offset = (t - bases[n + i - 1]) % runner.vocab_size
            counts[min(offset, NUM_BINS - 1)] += 1
    assert sum(counts) >= NUM_SAMPLES
    p_value = chi_square_p(counts, _geometric_bins(1.0, runner.vocab_size))
    assert p_value > MIN_P_VALUE, (mode, counts, p_value)
    # The acceptance is the rule's: p(mode) per draft tried for the right proposer.
    accepted = sum(a for _, a in outcomes)
    tried = sum(min(a + 1, d) for d, a in outcomes)
    expected_rate = {"right": 1 - math.exp(-1), "wrong": 0.0, "half": (1 - math.exp(-1)) / 2}
    assert len(outcomes) > 1000
    rate = accepted / tried
    sigma = math.sqrt(expected_rate[mode] * (1 - expected_rate[mode]) / tried)
    assert abs(rate - expected_rate[mode]) <= 4 * sigma + 1e-12, (mode, rate)


# -- sample_and_verify on a processed distribution ------------------------------------------------


VOCAB = 8
LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -3.0]] * 2)  # rows 0 and 1
PARAMS = [
    SamplingParams(temperature=0.9, top_k=5, max_tokens=8),
    SamplingParams(temperature=1.2, top_p=0.85, min_p=0.1, max_tokens=8),
    SamplingParams(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.4, max_tokens=8),
]


def _processed(params: SamplingParams, row: torch.Tensor, outputs: list[int]) -> list[float]:
    """The target distribution the sampler draws from (an independent computation)."""
    lg = row.clone()
    if params.has_penalties:  # the sampler's own penalty code, on the row's outputs
        _apply_penalties(lg, SampleRequest(params, 0, len(outputs), [1], outputs, ()))
    lg = lg / params.temperature
    if params.top_k > 0:
        kth = torch.topk(lg, params.top_k).values[-1]
        lg[lg < kth] = float("-inf")
    p = torch.softmax(lg, -1)
    if params.top_p < 1.0:
        sp, order = p.sort(descending=True)
        keep = (sp.cumsum(0) - sp) < params.top_p
        p = torch.zeros_like(p).scatter_(0, order, sp * keep)
    if params.min_p > 0:
        p[p < params.min_p * p.max()] = 0
    return (p / p.sum()).tolist()


def _merge_rare(observed: list[int], probs: list[float]) -> tuple[list[int], list[float]]:
    """Bins of zero probability must stay empty; the rest, with an even number of degrees of
    freedom (small bins merged into the last), go to the test."""
    for o, p in zip(observed, probs, strict=True):
        if p == 0:
            assert o == 0, "a token of probability 0 was emitted"
    pairs = sorted(((p, o) for o, p in zip(observed, probs, strict=True) if p > 0), reverse=True)
    while len(pairs) > 2 and (pairs[-1][0] * NUM_SAMPLES < 20 or (len(pairs) - 1) % 2):
        p, o = pairs.pop()
        pairs[-1] = (pairs[-1][0] + p, pairs[-1][1] + o)
    return [o for _, o in pairs], [p for p, _ in pairs]


@pytest.mark.parametrize("params", PARAMS, ids=["top_k", "top_p_min_p", "penalties"])
@pytest.mark.parametrize("mode", ["right", "wrong"])  # half right: the engine test above
def test_verification_emits_the_processed_distribution(mode: str, params: SamplingParams) -> None:
    p0 = _processed(params, LOGITS[0], [3])
    mode_token = max(range(VOCAB), key=lambda v: p0[v])
    zero = min(range(VOCAB), key=lambda v: p0[v])
    first = [0] * VOCAB
    second: dict[int, list[int]] = {}
    items = []
    for seed in range(NUM_SAMPLES):
        draft = {"right": mode_token, "wrong": zero, "half": (mode_token, zero)[seed % 2]}[mode]
        req = Request(f"x{seed}", [1], params, seed, (0,), output_token_ids=[3])
        req.num_computed_tokens = 1
        items.append(ScheduledRequest(req, 2, [0], [draft]))
    out = sample_and_verify(LOGITS.repeat(NUM_SAMPLES, 1), items)
    for rid, em in out.per_request().items():
        draft = items[int(rid[1:])].draft_token_ids[0]
        first[em.token_ids[0]] += 1
        if len(em.token_ids) == 2:
            assert em.token_ids[0] == draft
            second.setdefault(draft, [0] * VOCAB)[em.token_ids[1]] += 1
    obs, probs = _merge_rare(first, p0)
    assert chi_square_p(obs, probs) > MIN_P_VALUE, (mode, first, p0)
    for draft, counts in second.items():
        # After an accepted draft, the next row's distribution counts it as an output token.
        p1 = _processed(params, LOGITS[1], [3, draft])
        n = sum(counts)
        assert n > 0.3 * NUM_SAMPLES * p0[draft]
        obs, probs = _merge_rare(counts, p1)
        assert chi_square_p(obs, probs) > MIN_P_VALUE, (mode, draft, counts, p1)
    if mode == "wrong" and p0[zero] == 0:
        assert not second  # a draft of probability 0 is never accepted


def test_the_reference_processing_is_the_samplers() -> None:
    # Guard for the test above: with the same seed, the sampler's draw equals a draw from the
    # reference distribution by the same exponential race.
    for params in PARAMS:
        for seed in range(50):
            r = SampleRequest(params, seed, 1, [1], [3], ())
            token = _sample_row(LOGITS[0].clone(), r)
            p = torch.tensor(_processed(params, LOGITS[0], [3]))
            gen = torch.Generator().manual_seed(draw_seed(seed, 1))
            noise = torch.empty(VOCAB).exponential_(generator=gen)
            assert token == int((p / noise).argmax())
