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


class Drafts(list[int]):
    """One request's guesses, with the class of evidence they came from (``evidence``; the
    n-gram proposer: the length of the suffix it matched). Drafts of one class share an
    acceptance estimate in the speculator, so a proposer that can tell its sure guesses from its
    long shots gets the sure ones verified first. A plain list is class 0."""

    evidence: int = 0

    def __init__(self, tokens: Sequence[int] = (), evidence: int = 0) -> None:
        super().__init__(tokens)
        self.evidence = evidence


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        """Up to ``max_drafts[i]`` guesses of the tokens after ``requests[i]``'s last one
        (each a ``Drafts`` where the proposer knows how sure it is)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is gone: drop what the proposer kept of it."""
        ...


class NgramProposer:
    """Prompt lookup: find the longest suffix of the tokens (``min_ngram``..``max_ngram`` long)
    that occurred earlier in them, most recent occurrence first, and propose what followed it.

    Suits outputs that quote their context (summaries, code edits, RAG answers). Stateless: each
    call searches the request's current tokens (vectorised; tens of microseconds at 2k tokens).
    The evidence class of each request's drafts is the matched length: the longer the match, the
    likelier its drafts are right (figures: docs/design/decisions.md, "N-gram drafts by match
    length").
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.min_ngram
        self.max_n = config.max_ngram
        # each request's tokens as an array, extended by its new outputs step by step (a fresh
        # array of the whole list every step cost more than the search at batch 8)
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = []
        for r, k in zip(requests, max_drafts, strict=True):
            if k <= 0:
                out.append(Drafts())
                continue
            drafts, matched = lookup_match(self._array(r), self.min_n, self.max_n, k)
            out.append(Drafts(drafts, matched))
        return out

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _array(self, r: Request) -> np.ndarray:
        """``r``'s prompt and output tokens as an int64 array (a view of its buffer)."""
        prompt, out = r.num_prompt_tokens, r.output_token_ids
        n = prompt + len(out)
        t = self._tokens.get(r.request_id)
        if t is None or t.prompt != prompt or t.n > n:  # new, or not this request's tokens
            t = self._tokens[r.request_id] = _Tokens(np.empty(max(64, 2 * n), np.int64), prompt)
            t.buf[:n] = r.all_token_ids
        elif t.n < n:
            if n > t.buf.shape[0]:
                t.buf = np.concatenate((t.buf[: t.n], np.empty(n, np.int64)))
            t.buf[t.n : n] = out[t.n - prompt :]
        t.n = n
        return t.buf[:n]


class _Tokens:
    __slots__ = ("buf", "n", "prompt")

    def __init__(self, buf: np.ndarray, prompt: int) -> None:
        self.buf, self.n, self.prompt = buf, 0, prompt


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """tokens: [L] int64. The up to ``k`` tokens after the most recent earlier occurrence of the
    longest suffix of ``tokens`` with ``min_n <= length <= max_n``; [] when none occurs."""
    return lookup_match(tokens, min_n, max_n, k)[0]


def lookup_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """``lookup``'s drafts and the length of the suffix they follow (0: none)."""
    num = tokens.shape[0]
    if num <= min_n:
        return [], 0
    # Candidate ends j < num - 1 of an earlier occurrence: tokens[j] equals the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return [], 0
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
        return [], 0
    j = int(ends[length == best][-1])  # the most recent of the longest matches
    return tokens[j + 1 : j + 1 + k].tolist(), best
