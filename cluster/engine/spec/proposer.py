"""Draft proposers: ``propose(requests, max_drafts) -> drafts``, one list of guesses a request.

A proposer only guesses; verification makes the output exact whatever it proposes, so a bad
proposer costs speed, never correctness. ``NgramProposer`` (prompt lookup) needs no model: it
reads only the request's own tokens (prompt + output), so it works unchanged on a decode
replica that imported the prompt's KV and never saw the prompt computed. A draft model would be
another implementation of the same interface (one batched forward over ``requests``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from cluster.config import SpeculativeConfig
from cluster.engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        """Up to ``max_drafts[i]`` guesses of the tokens after ``requests[i]``'s last one."""
        ...


class NgramProposer:
    """Prompt lookup: find the longest suffix of the tokens (``min_ngram``..``max_ngram`` long)
    that occurred earlier in them, most recent occurrence first, and propose what followed it.

    Suits outputs that quote their context (summaries, code edits, RAG answers). Stateless: each
    call searches the request's current tokens (vectorised; tens of microseconds at 2k tokens).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.min_ngram
        self.max_n = config.max_ngram

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        return [
            lookup(np.asarray(r.all_token_ids, dtype=np.int64), self.min_n, self.max_n, k)
            if k > 0
            else []
            for r, k in zip(requests, max_drafts, strict=True)
        ]


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [L] int64. The up to ``k`` tokens after the most recent earlier occurrence of the
    longest suffix of ``tokens`` with ``min_n <= length <= max_n``; [] when none occurs."""
    num = tokens.shape[0]
    if num <= min_n:
        return []
    # Candidate ends j < num - 1 of an earlier occurrence: tokens[j] equals the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # matched suffix length at each candidate
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, min(max_n, num - 1)):
        idx = ends - m
        alive &= idx >= 0
        alive[alive] = tokens[idx[alive]] == tokens[num - 1 - m]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return []
    j = int(ends[length == best][-1])  # the most recent of the longest matches
    return tokens[j + 1 : j + 1 + k].tolist()
