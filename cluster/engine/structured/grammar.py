"""Compiling JSON Schemas for llguidance: the vocabulary and the per-replica grammar cache.

A schema compiles once per replica (``GrammarCache``, keyed by the SHA-256 of its text): the
cached entry is a fresh matcher, and each request gets a ``deep_copy`` of it (cheap: the
lexer and parser tables are shared), and the closing of its empty document (``closing``: the
schema's shortest document, what admission checks ``max_tokens`` against). The vocabulary
(``LLTokenizer``) is built once, on the first structured request: every token's bytes, from the
model's fast tokenizer or the fake runner's ``FakeTokenizer``.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from typing import Any

import llguidance

from cluster.common.json_schema import schema_grammar
from cluster.engine.structured.closing import Closer

_FAKE_WORD = re.compile(rb" t(\d+)")


class _FakeVocab:
    """The fake runner's tokens as llguidance's ``TokenizerWrapper`` wants them."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = list(tokenizer.eos_token_ids)
        self.tokens = [
            b"<eos>" if t in tokenizer.eos_token_ids else tokenizer.token_text(t).encode()
            for t in range(vocab_size)
        ]
        self._ascii = tokenizer.ascii_tokens
        self._vocab_size = vocab_size

    def __call__(self, text: bytes | str) -> list[int]:
        """The canonical tokens of ``text``: `` t<id>`` words, else (ASCII mode) single bytes."""
        data = text.encode() if isinstance(text, str) else text
        ids: list[int] = []
        i = 0
        while i < len(data):
            m = _FAKE_WORD.match(data, i)
            if (
                m is not None
                and int(m[1]) < self._vocab_size
                and (int(m[1]) >= 128 or not self._ascii)
            ):
                ids.append(int(m[1]))
                i = m.end()
                continue
            if self._ascii and 0 < data[i] < 128:
                ids.append(data[i])
            i += 1  # a byte no token spells: dropped (llguidance falls back to its own)
        return ids


def build_vocab(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance vocabulary of the model's tokenizer (``vocab_size``: the logits' width)."""
    if hasattr(tokenizer, "token_text"):  # the fake runner's FakeTokenizer
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_FakeVocab(tokenizer, vocab_size))
        )
    hf = tokenizer._tok  # the tokenizers.Tokenizer behind cluster.common.tokenizer.Tokenizer
    return llguidance.LLTokenizer(
        hf.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
    )


class GrammarCache:
    """Schema text -> a fresh matcher of its grammar and its shortest document's tokens (LRU,
    ``capacity`` entries)."""

    def __init__(self, vocab: llguidance.LLTokenizer, max_bytes: int, capacity: int = 128) -> None:
        self.vocab = vocab
        self.closer = Closer(vocab)
        self.max_bytes = max_bytes
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[llguidance.LLMatcher, list[int] | None]] = (
            OrderedDict()
        )
        self.num_compiled = 0

    def _entry(self, schema_text: str) -> tuple[llguidance.LLMatcher, list[int] | None]:
        # surrogatepass: a lone surrogate must reach the validator, which names the problem
        key = hashlib.sha256(schema_text.encode("utf-8", "surrogatepass")).hexdigest()
        entry = self._entries.get(key)
        if entry is None:
            grammar = schema_grammar(schema_text, "json_schema", self.max_bytes)
            template = llguidance.LLMatcher(self.vocab, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"json_schema: {template.get_error()}")
            self.num_compiled += 1
            entry = self._entries[key] = (template, self.closer.plan(template))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return entry

    def matcher(self, schema_text: str) -> llguidance.LLMatcher:
        """A new matcher at the start of the schema's grammar; ``ValueError`` if it is bad."""
        return self._entry(schema_text)[0].deep_copy()

    def shortest(self, schema_text: str) -> list[int] | None:
        """The tokens of the schema's shortest document (the closing of the empty one; None:
        none within ``Closer.max_steps``)."""
        return self._entry(schema_text)[1]
