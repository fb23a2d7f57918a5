"""Incremental detokenization: a growing list of token ids -> text deltas, stop strings held."""

from __future__ import annotations

from collections.abc import Sequence

from cluster.common.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, safe for multi-token characters.

    Decodes a short window (``prefix_offset:``) each step instead of the whole output, and holds
    back text that may still become a stop string, so a streamed delta is never retracted.
    """

    __slots__ = (
        "_emitted",
        "_include_stop",
        "_max_stop_len",
        "_prefix_offset",
        "_read_offset",
        "_skip_special",
        "_stops",
        "_tokenizer",
        "text",
        "token_ids",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop  # a matched stop string stays in the text
        self._stops = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._skip_special = skip_special_tokens
        # A few context tokens make the first output token decode with its leading space right.
        self.token_ids: list[int] = list(context_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)
        self.text = ""
        self._emitted = 0

    def add(self, token_id: int) -> str | None:
        """Append one token. Returns the matched stop string if the text now contains one."""
        self.token_ids.append(token_id)
        prefix_text = self._tokenizer.decode(
            self.token_ids[self._prefix_offset : self._read_offset], self._skip_special
        )
        new_text = self._tokenizer.decode(self.token_ids[self._prefix_offset :], self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        if not self._stops:
            return None
        window = self.text[max(0, start - self._max_stop_len + 1) :]
        base = len(self.text) - len(window)
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = window.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: base + best[0] + (len(best[1]) if self._include_stop else 0)]
        return best[1]

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keeps back what may start a stop string."""
        end = (
            len(self.text)
            if finished
            else max(self._emitted, len(self.text) - self._max_stop_len + 1)
        )
        if self._max_stop_len == 0:
            end = len(self.text)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
