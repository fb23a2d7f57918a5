"""Sampling parameters and request validation, shared by the router and the engine (torch-free).

Every check raises ``ValueError`` naming the offending field, so a bad request is refused before
it reaches any worker and never disturbs the others in a batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64  # each is checked against every new token
MAX_SAMPLES = 16  # n (and best_of): samples of one prompt


def _bad(name: str, message: str) -> ValueError:
    return ValueError(f"{name}: {message}")


def _finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past a float's range
        raise _bad(name, f"out of range, got an integer of {len(str(abs(value)))} digits") from None
    if not finite:
        raise _bad(name, f"must be a finite number, got {value!r}")


def _integer(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")


def _in_range(name: str, value: float, low: int, high: int, *, low_open: bool = False) -> None:
    """A finite ``value`` in [low, high] ((low, high] with ``low_open``)."""
    _finite(name, value)
    if not (low < value if low_open else low <= value) or value > high:
        raise _bad(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a dict or pairs) as (token id, float bias) pairs, each checked: ids >= 0,
    biases in [-100, 100]."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    for t, b in (p if isinstance(p, tuple | list) and len(p) == 2 else (p, 0) for p in pairs):
        _integer("logit_bias", t)
        _finite("logit_bias", b)
        if t < 0 or not -100 <= b <= 100:
            raise _bad("logit_bias", f"ids >= 0, biases in [-100, 100]; got {t}: {b}")
    return tuple((t, float(b)) for t, b in pairs)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: off; over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: the engine draws one per request (recompute stays exact)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    json_schema: str | None = None  # a JSON Schema (its JSON text): the output must match it
    prompt_logprobs: int | None = None  # k: each prompt token's logprob and top k (no caching)
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._check_lengths()
        self._check_sampling_knobs()
        self._check_stops()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (type(k) is not int or not 0 <= k <= MAX_LOGPROBS):
                raise _bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise _bad("json_schema", "must be a JSON Schema as JSON text (a string)")
        for name in ("stop", "stop_token_ids"):  # lists from JSON/YAML: hashable, immutable
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def _check_lengths(self) -> None:
        _integer("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise _bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        _integer("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    def _check_sampling_knobs(self) -> None:
        _in_range("temperature", self.temperature, 0, 2)
        _in_range("top_p", self.top_p, 0, 1, low_open=True)
        _integer("top_k", self.top_k)
        if self.top_k < -1:
            raise _bad("top_k", f"must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _in_range("min_p", self.min_p, 0, 1)
        _in_range("repetition_penalty", self.repetition_penalty, 0, 2, low_open=True)
        _in_range("presence_penalty", self.presence_penalty, -2, 2)
        _in_range("frequency_penalty", self.frequency_penalty, -2, 2)
        if self.seed is not None:
            _integer("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise _bad("seed", f"must be in [0, 2**63), got {self.seed}")

    def _check_stops(self) -> None:
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple | list):
            raise _bad("stop", "must be a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_LEN:
                raise _bad("stop", f"a stop string is at most {MAX_STOP_STRING_LEN} characters")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple | list) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} ids")
        for t in ids:
            _integer("stop_token_ids", t)
            if t < 0:
                raise _bad("stop_token_ids", f"token ids must be >= 0, got {t}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        return penalties != (1.0, 0.0, 0.0)

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in _WIRE_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SamplingParams:
        unknown = sorted(set(data) - set(_WIRE_FIELDS))
        if unknown:
            raise _bad(unknown[0], f"unknown sampling parameter; valid: {', '.join(_WIRE_FIELDS)}")
        return cls(**data)  # type: ignore[arg-type]


_WIRE_FIELDS = tuple(f for f in SamplingParams.__dataclass_fields__ if f != "extra")


def validate_prompt(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Request-level checks that need the model: lengths against the context, ids in the vocab."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise _bad("prompt", "prompt cannot be empty")
    if num_prompt >= max_model_len:
        raise _bad(
            "prompt",
            f"prompt has {num_prompt} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}",
        )
    if num_prompt + params.max_tokens > max_model_len:
        raise _bad(
            "max_tokens",
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
            f"{num_prompt + params.max_tokens} exceeds max_model_len={max_model_len}",
        )
    # The common case in C loops (exact ints: bool is not an id); the slow loop names the culprit.
    ids = prompt_token_ids
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        ids = ()
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise _bad(
                "prompt_token_ids",
                f"token id {t!r} at position {i} is outside the vocabulary [0, {vocab_size})",
            )
    for name, t in [("stop_token_ids", t) for t in params.stop_token_ids] + [
        ("logit_bias", t) for t, _ in params.logit_bias
    ]:
        if t >= vocab_size:
            raise _bad(name, f"token id {t} is outside the vocabulary [0, {vocab_size})")
