"""Step-cost profiles: what one engine step, one KV pull and one serving hop cost on a machine.

``pdserve profile`` (``cluster.planner.measure.profiler``) measures them on the actual hardware
and writes a JSON file of this shape (``format: pdserve-profile/1``); the simulator reads it:

  * ``steps[key]``: per torch-thread count (CPU; ``steps_key``: ``"2"``, or ``"1tp2"`` for an
    engine of 2 tensor-parallel ranks of 1 thread each) or per device (GPU: one entry):
      - ``prefill``: one prefill chunk of N tokens at context 0: ``tokens`` -> ``seconds``;
      - ``prefill_context_s``: extra seconds per (chunk token x earlier context token);
      - ``decode``: a decode step of B sequences at mean context C: a ``batch`` x ``context``
        grid of ``seconds``.
    A step of mixed work costs the decode grid's figure for its decodes, plus the prefill
    table's figure for its prefill tokens above the step's floor (the prefill line at 0
    tokens), plus the context term: one batched forward whose matrix work grows with the tokens
    it carries.
  * ``transfer[transport]``: one pull costs ``fixed_s + bytes / bytes_per_s``.
  * ``serving[arm kind]`` (``local``: a colocated replica; ``remote``: prefill and decode apart):
    what the serving stack adds around the engine, from unloaded requests on a local cluster:
    ``ttft_overhead_s`` (client TTFT minus the engine's queue and prefill), ``token_overhead_s``
    (client TPOT minus the engine's decode step), ``prefill_scale`` / ``decode_scale``
    (engine step time inside a replica over the bare engine's: CPU the stack takes), for
    remote, ``handoff_s`` (the first gap's excess over the pull and a decode step: the hops
    from the first token to the request's first decode step), ``stream_s`` (from a burst
    of concurrent requests: what a streaming step gains per streamed token beyond the first)
    and, for remote, ``decode_contention`` / ``prefill_contention`` (a step's extra time, as a
    fraction, while the other pool's engine is busy: a long prompt sent into the burst).
  * ``model``: block size and KV bytes per block (what a transfer moves).

Interpolation is piecewise linear (bilinear on the decode grid) and linear past the last point.
Every reader check names the field that is wrong.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "pdserve-profile/1"


def steps_key(threads: int, tp: int = 1) -> str:
    """The ``steps`` key of an engine of ``tp`` ranks of ``threads`` threads each."""
    return str(threads) if tp == 1 else f"{threads}tp{tp}"


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _increasing(name: str, xs: Sequence[float]) -> None:
    if not xs or any(b <= a for a, b in itertools.pairwise(xs)):
        raise ValueError(f"profile: {name} must be a non-empty, strictly increasing list")


@dataclass(frozen=True)
class StepCosts:
    prefill_tokens: tuple[float, ...]
    prefill_seconds: tuple[float, ...]
    prefill_context_s: float
    decode_batch: tuple[float, ...]
    decode_context: tuple[float, ...]
    decode_seconds: tuple[tuple[float, ...], ...]  # [batch][context]

    def __post_init__(self) -> None:
        _increasing("prefill.tokens", self.prefill_tokens)
        _increasing("decode.batch", self.decode_batch)
        _increasing("decode.context", self.decode_context)
        if len(self.prefill_seconds) != len(self.prefill_tokens):
            raise ValueError("profile: prefill.seconds must have one entry per prefill.tokens")
        if len(self.decode_seconds) != len(self.decode_batch) or any(
            len(row) != len(self.decode_context) for row in self.decode_seconds
        ):
            raise ValueError("profile: decode.seconds must be a batch x context grid")
        if min(self.prefill_seconds) <= 0 or min(min(r) for r in self.decode_seconds) <= 0:
            raise ValueError("profile: step seconds must be > 0")
        if self.prefill_context_s < 0:
            raise ValueError("profile: prefill_context_s must be >= 0")

    def prefill(self, tokens: float) -> float:
        return max(1e-6, _interp(self.prefill_tokens, self.prefill_seconds, tokens))

    @property
    def step_floor(self) -> float:
        """What a step costs before its tokens (weights read, launch, bookkeeping): the prefill
        line through its two smallest multi-token points, at 0 tokens (at most a 1-token
        step). Beside decodes, a prefill chunk adds its cost above this."""
        pts = [(x, y) for x, y in zip(self.prefill_tokens, self.prefill_seconds) if x > 1][:2]
        first = self.prefill_seconds[0]
        if len(pts) < 2:
            return first
        (x0, y0), (x1, y1) = pts
        return min(first, max(0.0, y0 - x0 * (y1 - y0) / (x1 - x0)))

    def decode(self, batch: float, context: float) -> float:
        by_batch = [_interp(self.decode_context, row, context) for row in self.decode_seconds]
        return max(1e-6, _interp(self.decode_batch, by_batch, batch))

    def step(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        """One step: ``prefill`` (tokens fed, context before them) per chunk, ``decode`` the
        context of each decoding sequence."""
        t = 0.0
        if decode:
            t = self.decode(len(decode), sum(decode) / len(decode))
        n = sum(tokens for tokens, _ in prefill)
        if n:
            t += self.prefill(n) - (self.step_floor if decode else 0.0)
            t += self.prefill_context_s * sum(tokens * ctx for tokens, ctx in prefill)
        return t

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": {"tokens": list(self.prefill_tokens), "seconds": list(self.prefill_seconds)},
            "prefill_context_s": self.prefill_context_s,
            "decode": {
                "batch": list(self.decode_batch),
                "context": list(self.decode_context),
                "seconds": [list(r) for r in self.decode_seconds],
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> StepCosts:
        try:
            return cls(
                tuple(float(x) for x in d["prefill"]["tokens"]),
                tuple(float(x) for x in d["prefill"]["seconds"]),
                float(d["prefill_context_s"]),
                tuple(float(x) for x in d["decode"]["batch"]),
                tuple(float(x) for x in d["decode"]["context"]),
                tuple(tuple(float(x) for x in row) for row in d["decode"]["seconds"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile: {where}: missing or malformed field {e}") from None
        except ValueError as e:
            raise ValueError(f"{e} (in {where})") from None


@dataclass(frozen=True)
class TransferCost:
    fixed_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class ServingCost:
    ttft_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    handoff_s: float = 0.0  # remote: the KV landed -> the request in the decode batch
    # Seconds a streaming engine's step (colocated or decode) gains per token it streams beyond
    # the first: the stack's work per streamed token (replica, Ray, router, client) on the cores
    # the engine runs on. Unloaded requests stream one at a time and cannot see it; a burst
    # of concurrent requests does (``cluster.planner.calibration.burst_costs``).
    stream_s: float = 0.0
    # remote: how much longer a decode (prefill) step takes while the other pool's engine is
    # busy too, as a fraction: replicas that share a machine's cores (and its serving stack)
    # slow each other down; replicas on cores or devices of their own measure about 0.
    decode_contention: float = 0.0
    prefill_contention: float = 0.0


@dataclass(frozen=True)
class Profile:
    device: dict[str, Any]
    model: dict[str, Any]  # name, block_size, bytes_per_block
    steps: dict[str, StepCosts]  # by thread count ("1", "2") or "device"
    transfer: dict[str, TransferCost]
    serving: dict[str, ServingCost] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)  # raw points and self-checks

    @property
    def block_size(self) -> int:
        return int(self.model["block_size"])

    @property
    def bytes_per_block(self) -> int:
        return int(self.model["bytes_per_block"])

    def costs(self, threads: int | str, tp: int = 1) -> StepCosts:
        key = steps_key(int(threads), tp) if isinstance(threads, int) else threads
        if key not in self.steps:
            if len(self.steps) == 1 and tp == 1:
                return next(iter(self.steps.values()))  # one device: one table
            raise ValueError(f"profile: no step costs for {key!r}; have {sorted(self.steps)}")
        return self.steps[key]

    def tensor_parallel_sizes(self, threads: int = 1) -> list[int]:
        """The TP sizes this profile has step costs for at ``threads`` threads per rank."""
        return sorted(tp for tp in range(1, 65) if steps_key(threads, tp) in self.steps)

    def transfer_cost(self, transport: str) -> TransferCost:
        if transport not in self.transfer:
            raise ValueError(
                f"profile: no transfer cost for {transport!r}; have {sorted(self.transfer)}"
            )
        return self.transfer[transport]

    def serving_cost(self, kind: str) -> ServingCost:
        return self.serving.get(kind, ServingCost())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "device": self.device,
            "model": self.model,
            "steps": {k: v.to_dict() for k, v in self.steps.items()},
            "transfer": {k: vars(v) for k, v in self.transfer.items()},
            "serving": {k: vars(v) for k, v in self.serving.items()},
            "measured": self.measured,
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        if d.get("format") != FORMAT:
            raise ValueError(f"profile: format {d.get('format')!r}, expected {FORMAT!r}")
        for key in ("device", "model", "steps", "transfer"):
            if key not in d:
                raise ValueError(f"profile: missing section {key!r}")
        model = dict(d["model"])
        for key in ("block_size", "bytes_per_block"):
            if not isinstance(model.get(key), int) or model[key] < 1:
                raise ValueError(f"profile: model.{key} must be a positive integer")
        try:
            transfer = {
                k: TransferCost(float(v["fixed_s"]), float(v["bytes_per_s"]))
                for k, v in d["transfer"].items()
            }
            serving = {k: ServingCost(**v) for k, v in d.get("serving", {}).items()}
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile: transfer or serving: malformed ({e})") from None
        if any(t.bytes_per_s <= 0 or t.fixed_s < 0 for t in transfer.values()):
            raise ValueError("profile: transfer bytes_per_s must be > 0 and fixed_s >= 0")
        steps = {k: StepCosts.from_dict(v, f"steps.{k}") for k, v in d["steps"].items()}
        if not steps:
            raise ValueError("profile: steps is empty")
        return cls(dict(d["device"]), model, steps, transfer, serving, dict(d.get("measured", {})))

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"profile: no such file {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile: {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)


EXAMPLE_PROFILE = Path(__file__).parent / "profiles" / "cpu-2core-smollm2.json"
