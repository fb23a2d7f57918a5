"""Closing a document within its budget: the shortest completion the grammar accepts.

``Closer.plan(matcher)`` returns a token sequence that takes the matcher from its state to one
the grammar accepts (a complete document: strings closed, numbers finished, required
properties supplied with the shortest values the schema allows, arrays and objects closed), or
None when none is found within ``max_steps`` tokens. It works on a ``deep_copy``; the matcher
itself never moves.

The plan is built one token at a time by a fixed rule, a function of the grammar state alone
(so a decode replica that replays the same tokens gets the same plan):

  1. the state accepts: done;
  2. the grammar forces bytes (``compute_ff_bytes``): their tokens (the vocabulary's own
     tokenization, as far as the grammar allows it; forced bytes are on every completion);
  3. else the first allowed of a short list of single-character tokens, in an order that
     shortens the document: ``}`` and ``]`` when they close a structure (a ``"`` cannot follow
     them; inside a string they are content and skipped), ``"`` (ends a string, or starts the
     empty one), ``t n f`` (``true``, ``null``, ``false``, the rest forced), the other letters
     but ``e E`` (string content, an enum, a pattern), ``,`` (a property or item is still
     missing: a digit would only lengthen the number), digits (``0`` first: the shortest
     number; the first after which the number may end, so ``-0.0`` does not spin in zeros),
     ``[ {``, ``e E``, then the rest of printable ASCII;
  4. else (the vocabulary has no such single-character token) the lowest allowed token.

Greedy, not a search: the plan is short (a closing brace per open structure, one shortest
value per missing property) but not proven the shortest possible. The budget is kept exactly
all the same: ``StructuredOutput`` keeps the invariant "this plan fits in the tokens left",
whatever plan the rule gives.
"""

from __future__ import annotations

import string

import llguidance
import numpy as np

_STRUCTURAL = b"}]"
_LETTERS = bytes(sorted(set(string.ascii_letters.encode()) - set(b"tnfeE")))
_ORDER = b'"tnf' + _LETTERS + b"," + b"0123456789" + b"[{eE"
_ORDER += bytes(sorted(set(string.printable.encode()) - set(_ORDER) - set(_STRUCTURAL)))


class Closer:
    def __init__(self, vocab: llguidance.LLTokenizer, max_steps: int = 1024) -> None:
        self.max_steps = max_steps
        self.vocab = vocab
        self.eos = vocab.eos_token
        single: dict[int, int] = {}
        for byte in set(_STRUCTURAL) | set(_ORDER):
            ids = vocab.tokenize_bytes(bytes([byte]))
            if len(ids) == 1 and vocab.decode_bytes(ids) == bytes([byte]):
                single[byte] = ids[0]
        self._structural = [single[b] for b in _STRUCTURAL if b in single]
        self._quote = single.get(ord('"'))
        self._order = [single[b] for b in _ORDER if b in single]
        self._digits = {single[b] for b in b"0123456789" if b in single}
        self._terminators = [single[b] for b in b',}]"' if b in single]
        self.num_plans = 0
        self.num_plan_tokens = 0

    def plan(
        self, matcher: llguidance.LLMatcher, max_len: int | None = None, then: int | None = None
    ) -> list[int] | None:
        """The closing of ``matcher``'s document, after the token ``then`` if given (``[]``: it
        is complete); None if it takes more than ``max_len`` tokens (default ``max_steps``) or
        none is found."""
        limit = self.max_steps if max_len is None else min(max_len, self.max_steps)
        self.num_plans += 1
        if then is None and matcher.is_accepting():
            return []
        m = matcher.deep_copy()
        if then is not None and not m.consume_token(then):
            return None
        out: list[int] = []
        while not m.is_accepting():
            if m.is_error() or m.is_stopped():
                return None
            tokens = self._next(m)
            if not tokens or len(out) + len(tokens) > limit or not m.consume_tokens(tokens):
                return None
            out.extend(tokens)
        self.num_plan_tokens += len(out)
        return out

    def _next(self, m: llguidance.LLMatcher) -> list[int]:
        """The next tokens of the plan: the forced bytes' tokens, or one candidate."""
        forced = m.compute_ff_bytes()
        if forced:
            tokens = self.vocab.tokenize_bytes(forced)
            n = m.validate_tokens(tokens)
            if n:
                return list(tokens[:n])
        for token in self._structural:
            if m.validate_tokens([token]) == 1 and self._closes(m, token):
                return [token]
        fallback: int | None = None
        for token in self._order:
            if m.validate_tokens([token]) == 1:
                if token not in self._digits or self._ends_after(m, token):
                    return [token]
                fallback = token if fallback is None else fallback
        if fallback is not None:  # no digit lets the number end yet (``-0.0``): the first
            return [fallback]
        allowed = np.flatnonzero(
            np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        )
        allowed = allowed[allowed != self.eos]
        return [int(allowed[0])] if allowed.size else []

    def _ends_after(self, m: llguidance.LLMatcher, token: int) -> bool:
        """After the digit ``token`` the number may end (``0`` again would spin: ``-0.000``)."""
        m.consume_token(token)
        ends = m.is_accepting() or any(m.validate_tokens([t]) == 1 for t in self._terminators)
        m.rollback(1)
        return ends

    def _closes(self, m: llguidance.LLMatcher, token: int) -> bool:
        """``}`` / ``]`` ends a structure (not string content): no ``"`` may follow it."""
        if self._quote is None:
            return True
        m.consume_token(token)
        content = not m.is_accepting() and m.validate_tokens([self._quote]) == 1
        m.rollback(1)
        return not content
