"""Test proposers and statistics for speculative decoding.

Proposers with a known quality: ``ScriptedProposer`` proposes a known continuation (right),
its tokens shifted (wrong), or right for a share of the tokens (half right), so verification is
checked against exactly the acceptance pattern it should produce. ``FakeModeProposer`` knows
the fake runner's next-token function, so it can propose the most likely token (or an almost
impossible one) under sampling as well.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.fake_runner import FakeModelRunner
from cluster.engine.request import Request


class ScriptedProposer:
    """Proposes ``expected[request_id]`` from the request's output index on; each proposed
    token is replaced by a wrong one with probability ``wrong_share`` (seeded)."""

    def __init__(
        self, expected: dict[str, list[int]], vocab_size: int, wrong_share: float = 0.0
    ) -> None:
        self.expected = expected
        self.vocab_size = vocab_size
        self.wrong_share = wrong_share
        self.rng = random.Random(0)
        self.num_calls = 0

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        self.num_calls += 1
        out = []
        for r, k in zip(requests, max_drafts, strict=True):
            n = r.num_output_tokens
            ref = self.expected.get(r.request_id.split("#")[0], [])[n : n + k]
            out.append([self._spoil(t) for t in ref])
        return out

    def forget(self, request_id: str) -> None:
        pass

    def _spoil(self, token: int) -> int:
        if self.rng.random() < self.wrong_share:
            return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return token


class FakeModeProposer:
    """For the fake runner: proposes the chain of most likely tokens (``right``), tokens half
    the vocabulary away (probability ~e^-V/2: ``wrong``), or each of the two with probability
    1/2 (``half``)."""

    def __init__(self, runner: FakeModelRunner, mode: str, k: int) -> None:
        self.runner = runner
        self.mode = mode
        self.k = k
        self.rng = random.Random(1)

    def forget(self, request_id: str) -> None:
        pass

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, max_drafts, strict=True):
            tokens = list(r.all_token_ids)
            drafts = []
            for _ in range(min(k, self.k)):
                mode = fake_base(self.runner, tokens)
                wrong = self.mode == "wrong" or (self.mode == "half" and self.rng.random() < 0.5)
                token = (
                    (mode + self.runner.vocab_size // 2) % self.runner.vocab_size if wrong else mode
                )
                drafts.append(token)
                tokens.append(token)
            out.append(drafts)
        return out


def fake_base(runner: FakeModelRunner, tokens: Sequence[int]) -> int:
    """The fake model's most likely token after ``tokens`` (what it computes from the KV)."""
    ctx = len(tokens)
    lo = max(0, ctx - runner.fm.context_window)
    kv = runner.kv_values(torch.tensor(tokens[lo:ctx]), torch.arange(lo, ctx))
    checksum = int(kv.double().sum().item())
    return (checksum * 40503 + ctx) % runner.vocab_size


def fake_bases(runner: FakeModelRunner, tokens: Sequence[int]) -> list[int]:
    """``fake_base(runner, tokens[: i + 1])`` for every i, at once."""
    n = len(tokens)
    kv = runner.kv_values(torch.tensor(list(tokens)), torch.arange(n))
    sums = torch.cat([torch.zeros(1, dtype=torch.float64), kv.double().flatten(1).sum(1).cumsum(0)])
    ctx = torch.arange(1, n + 1)
    lo = (ctx - runner.fm.context_window).clamp(min=0)
    checksums = (sums[ctx] - sums[lo]).to(torch.long)
    return ((checksums * 40503 + ctx) % runner.vocab_size).tolist()


def use_proposer(engine: LLMEngine, proposer: object) -> None:
    """Swap the engine's proposer (its speculator keeps the config's adaptive policy)."""
    engine.speculator.proposer = proposer  # type: ignore[assignment]


def chi_square_sf_even_df(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with an even number of degrees of freedom (closed form)."""
    assert df % 2 == 0 and df > 0
    half = x / 2
    term = 1.0
    total = 1.0
    for i in range(1, df // 2):
        term *= half / i
        total += term
    return math.exp(-half) * total


def chi_square_p(observed: Sequence[int], probs: Sequence[float]) -> float:
    """Pearson's goodness-of-fit p-value (len(probs) - 1 must be even)."""
    n = sum(observed)
    stat = sum((o - n * p) ** 2 / (n * p) for o, p in zip(observed, probs, strict=True))
    return chi_square_sf_even_df(stat, len(probs) - 1)
