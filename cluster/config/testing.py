"""``testing``: test mode, fault points, forced preemption and the fake runner's model.

Everything here is test-only: fault points and forced preemption are refused unless
``testing.enabled`` is set, so a production config can never arm them by accident.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config.validation import check


@dataclass(frozen=True)
class FakeModelConfig:
    """The deterministic stand-in model of the ``fake`` runner (orchestration and fault tests)."""

    vocab_size: int = 512
    """Token ids of the fake model."""
    num_layers: int = 2
    """Layers of its KV cache."""
    num_kv_heads: int = 2
    """KV heads per layer."""
    head_dim: int = 16
    """Values per head."""
    context_window: int = 4
    """Next token = f(the KV read back from the last ``context_window`` positions), so missing or
    corrupt KV changes the output."""
    prefill_delay_per_token_s: float = 0.0
    """Emulated prefill compute per prompt token."""
    decode_delay_s: float = 0.0
    """Emulated compute of a step with at least one decode."""
    load_delay_s: float = 0.0
    """Once, when the runner is built: a real model's load time."""
    eos_token_id: int = 0
    """The end-of-sequence id."""
    ascii_tokens: bool = False
    """Ids 1..127 read as their ASCII character (the rest as `` t<id>``), so the fake model can
    spell grammar-constrained output (JSON) in structured-output tests."""

    def __post_init__(self) -> None:
        check(self.vocab_size >= 16, "testing.fake_model.vocab_size", "must be >= 16")
        for name in ("num_layers", "num_kv_heads", "head_dim", "context_window"):
            check(getattr(self, name) >= 1, f"testing.fake_model.{name}", "must be >= 1")
        check(
            self.prefill_delay_per_token_s >= 0,
            "testing.fake_model.prefill_delay_per_token_s",
            "must be >= 0",
        )
        check(self.decode_delay_s >= 0, "testing.fake_model.decode_delay_s", "must be >= 0")
        check(self.load_delay_s >= 0, "testing.fake_model.load_delay_s", "must be >= 0")


@dataclass(frozen=True)
class TestingConfig:
    enabled: bool = False
    """Test mode: the only way to turn on the two hooks below."""
    fault_points: tuple[str, ...] = ()
    """``<name>[:n][=action]``: act (kill, raise, hang, pause) the n-th time (default: the 1st) a
    worker reaches the named point."""
    force_preempt_interval: int = 0
    """Preempt the newest running request every N steps (0: off)."""
    fake_model: FakeModelConfig = field(default_factory=FakeModelConfig)
    """The ``fake`` runner's model (``model.runner: fake``)."""

    def __post_init__(self) -> None:
        check(self.force_preempt_interval >= 0, "testing.force_preempt_interval", "must be >= 0")
        for spec in self.fault_points:
            check(bool(spec.strip()), "testing.fault_points", "entries must be non-empty")
        if not self.enabled:
            check(
                not self.fault_points,
                "testing.fault_points",
                "fault points are test-only: set testing.enabled: true to use them",
            )
            check(
                self.force_preempt_interval == 0,
                "testing.force_preempt_interval",
                "forced preemption is test-only: set testing.enabled: true to use it",
            )
