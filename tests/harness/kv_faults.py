"""Scripted wire faults for deterministic fault tests (docs/reliability/matrix.md K1-K8, F19, F21).

A ``FaultyTransport`` is the ``WireFaults`` injector a test hands a ``KVSender`` or
``KVReceiver`` (``faults=``): their ``Framer`` asks it to rewrite the n-th message of a tag on
its way out (``send``) or in (``recv``):

  * message actions: ``drop``, ``duplicate``, ``delay`` (the wire's thread sleeps, as a slow link
    stalls a pipeline), ``blackhole`` (drop this and every later match: a partition);
  * frame actions on the message's raw frames (``frame`` indexes them): ``drop_frame``,
    ``truncate`` (keep ``nbytes``), ``flip`` (one bit, of a copy: pool memory is never touched),
    ``extra_frame`` (append ``nbytes`` zeros), ``oversize`` (replace with ``nbytes`` zeros).

Rules count matches independently; ``injected`` counts what was done, for assertions.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.kv_transfer.framing import Buffer

MESSAGE_ACTIONS = ("drop", "duplicate", "delay", "blackhole")
FRAME_ACTIONS = ("drop_frame", "truncate", "flip", "extra_frame", "oversize")


@dataclass(frozen=True)
class FaultRule:
    action: str
    tag: str = "chunk"  # message tag to match; "*" matches every message
    nth: int = 1  # the n-th matching message (blackhole: from the n-th on)
    direction: str = "send"  # send | recv
    frame: int = 0
    nbytes: int = 0
    delay_s: float = 0.0
    bit: int = 0

    def __post_init__(self) -> None:
        if self.action not in MESSAGE_ACTIONS + FRAME_ACTIONS:
            valid = ", ".join(MESSAGE_ACTIONS + FRAME_ACTIONS)
            raise ValueError(f"action: unknown {self.action!r}; valid: {valid}")
        if self.direction not in ("send", "recv"):
            raise ValueError("direction: send or recv")
        if self.nth < 1:
            raise ValueError("nth: must be >= 1")


class FaultyTransport:
    def __init__(self, rules: Sequence[FaultRule]) -> None:
        self.rules = tuple(rules)
        self._seen = [0] * len(self.rules)
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()

    def set_rules(self, rules: Sequence[FaultRule]) -> None:
        """Swap the script mid-test (partition now, heal later); counts start afresh."""
        with self._lock:
            self.rules = tuple(rules)
            self._seen = [0] * len(self.rules)

    def apply(self, direction: str, tag: str, frames: list[Buffer]) -> list[list[Buffer]]:
        """The messages to deliver instead of one with ``frames`` (empty list: none)."""
        out = [frames]
        with self._lock:
            rules, seen = self.rules, self._seen
        for i, rule in enumerate(rules):
            if rule.direction != direction or rule.tag not in ("*", tag):
                continue
            with self._lock:
                seen[i] += 1
                n = seen[i]
            due = n >= rule.nth if rule.action == "blackhole" else n == rule.nth
            if not due:
                continue
            self.injected[rule.action] += 1
            out = [self._rewrite(rule, m) for m in out]
            if rule.action in ("drop", "blackhole"):
                return []
            if rule.action == "duplicate":
                out = out + out
            elif rule.action == "delay":
                time.sleep(rule.delay_s)
        return out

    @staticmethod
    def _rewrite(rule: FaultRule, frames: list[Buffer]) -> list[Buffer]:
        if rule.action not in FRAME_ACTIONS:
            return frames
        frames = list(frames)
        if rule.action == "extra_frame":
            return [*frames, bytes(rule.nbytes)]
        if not 0 <= rule.frame < len(frames):
            return frames
        k = rule.frame
        if rule.action == "drop_frame":
            del frames[k]
        elif rule.action == "truncate":
            frames[k] = bytes(memoryview(frames[k]).cast("B")[: rule.nbytes])
        elif rule.action == "oversize":
            frames[k] = bytes(rule.nbytes)
        else:  # flip
            data = bytearray(memoryview(frames[k]).cast("B"))
            if data:
                bit = rule.bit % (len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
            frames[k] = bytes(data)
        return frames
