"""Workloads and SLOs, shared by the planner's simulator and the serving benchmark (torch-free).

A ``WorkloadMix`` is a mix of request classes (each a share, a prompt-length range and a pinned
output length) with an optional shared prefix; ``items`` draws the requests (token ids and all)
with a seeded RNG, so the benchmark and the simulator see the very same requests, and
``poisson_offsets`` their arrival times. ``SLOs`` are per class: TTFT and TPOT bounds for each
prompt-length class (docs/benchmarks/index.md, P1), so long prompts can meet theirs unloaded.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Token ids below this are left out of random prompts (special tokens sit at the start of the
# vocabularies we use: SmolLM2's 0-16, the tiny model's 0-2).
FIRST_PLAIN_TOKEN = 17


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float  # of the requests
    prompt: tuple[int, int]  # prompt tokens, uniform in [lo, hi]
    output: int  # output tokens (pinned: min_tokens = max_tokens, EOS ignored)

    def __post_init__(self) -> None:
        lo, hi = self.prompt
        if not self.name:
            raise ValueError("workload: a class needs a name")
        if not 0 < self.share <= 1:
            raise ValueError(f"workload.{self.name}.share: must be in (0, 1], got {self.share}")
        if not 2 <= lo <= hi:
            raise ValueError(f"workload.{self.name}.prompt: need 2 <= lo <= hi, got {self.prompt}")
        if self.output < 1:
            raise ValueError(f"workload.{self.name}.output: must be >= 1, got {self.output}")


@dataclass(frozen=True)
class WorkItem:
    token_ids: list[int]
    max_tokens: int
    cls: str = ""


@dataclass(frozen=True)
class WorkloadMix:
    name: str
    classes: tuple[RequestClass, ...]
    prefix_tokens: int = 0  # a system prompt every request starts with (0: none)
    prefix_share: float = 0.0  # share of the requests that carry it

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError(f"workload {self.name!r}: needs at least one class")
        total = sum(c.share for c in self.classes)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"workload {self.name!r}: class shares sum to {total}, not 1")
        if len({c.name for c in self.classes}) != len(self.classes):
            raise ValueError(f"workload {self.name!r}: class names repeat")
        if self.prefix_tokens < 0 or not 0 <= self.prefix_share <= 1:
            raise ValueError(f"workload {self.name!r}: prefix_tokens >= 0, prefix_share in [0, 1]")

    def items(self, num: int, vocab_size: int, seed: int, scale: float = 1.0) -> list[WorkItem]:
        """``num`` requests; ``scale`` shrinks every length (smoke runs on tiny models)."""
        rng = random.Random(seed)
        prefix_len = max(0, int(self.prefix_tokens * scale))
        prefix = [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(prefix_len)]
        items = []
        for _ in range(num):
            cls = self._pick(rng.random())
            n_in = rng.randint(*cls.prompt)
            n_in, n_out = max(2, int(n_in * scale)), max(2, int(cls.output * scale))
            ids = [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n_in)]
            if prefix and rng.random() < self.prefix_share:
                ids = prefix + ids
            items.append(WorkItem(ids, n_out, cls.name))
        return items

    def _pick(self, r: float) -> RequestClass:
        acc = 0.0
        for c in self.classes:
            acc += c.share
            if r < acc:
                return c
        return self.classes[-1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "classes": [
                {"name": c.name, "share": c.share, "prompt": list(c.prompt), "output": c.output}
                for c in self.classes
            ],
            "prefix_tokens": self.prefix_tokens,
            "prefix_share": self.prefix_share,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkloadMix:
        unknown = sorted(set(data) - {"name", "classes", "prefix_tokens", "prefix_share"})
        if unknown:
            raise ValueError(f"workload: unknown keys {unknown}")
        try:
            classes = tuple(
                RequestClass(
                    str(c["name"]), float(c["share"]), tuple(c["prompt"]), int(c["output"])
                )
                for c in data["classes"]
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"workload.classes: {e}") from None
        return cls(
            str(data.get("name", "custom")),
            classes,
            int(data.get("prefix_tokens", 0)),
            float(data.get("prefix_share", 0.0)),
        )


# docs/benchmarks ``mixed-long``: 80% chat (64-128 in / 64 out), 20% long (768-1024 in / 32 out).
CHAT = RequestClass("chat", 0.8, (64, 128), 64)
LONG = RequestClass("long", 0.2, (768, 1024), 32)
MIXED_LONG = WorkloadMix("mixed-long", (CHAT, LONG))
# The planner check's other two mixes: the same classes, other shares.
CHAT_HEAVY = WorkloadMix(
    "chat-heavy",
    (RequestClass("chat", 0.95, (64, 128), 64), RequestClass("long", 0.05, (768, 1024), 32)),
)
LONG_HEAVY = WorkloadMix(
    "long-heavy",
    (RequestClass("chat", 0.5, (64, 128), 64), RequestClass("long", 0.5, (768, 1024), 32)),
)
WORKLOADS = {w.name: w for w in (MIXED_LONG, CHAT_HEAVY, LONG_HEAVY)}


def load_workload(spec: str) -> WorkloadMix:
    """A named workload (``mixed-long``, ...) or a JSON file of ``WorkloadMix.to_dict()`` shape."""
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"workload: {spec!r} is neither a known name ({', '.join(WORKLOADS)}) nor a file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"workload: {path} is not valid JSON: {e}") from None
    return WorkloadMix.from_dict(data)


def poisson_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s from start) for a Poisson process (gamma, burstiness 1)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return out


@dataclass(frozen=True)
class SLOs:
    """Per prompt-length class: (TTFT seconds, TPOT seconds). A request meets its SLO when its
    TTFT and (for more than one output token) its TPOT are within its class's bounds."""

    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)

    def meets(self, cls: str, ttft: float, tpot: float | None) -> bool:
        if cls not in self.bounds:
            raise ValueError(f"SLOs: no bound for class {cls!r}; have {sorted(self.bounds)}")
        ttft_max, tpot_max = self.bounds[cls]
        return ttft <= ttft_max and (tpot is None or tpot <= tpot_max)

    @classmethod
    def from_unloaded(
        cls,
        unloaded: Mapping[str, tuple[float, float]],
        ttft_x: float,
        tpot_x: float,
    ) -> SLOs:
        """Multiples of per-class unloaded (p50 TTFT, p50 TPOT)."""
        return cls({c: (ttft_x * t, tpot_x * p) for c, (t, p) in unloaded.items()})

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {c: {"ttft_s": t, "tpot_s": p} for c, (t, p) in self.bounds.items()}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) as numpy's default; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
