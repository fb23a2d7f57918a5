"""Factory helpers for tests: configs, requests, and driving an engine by hand."""

from __future__ import annotations

from typing import Any

from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig, config_from_dict, load_config


def make_config(**overrides: Any) -> ClusterConfig:
    """A validated config; overrides are dotted paths: ``make_config(**{"cache.num_blocks": 8})``
    or section mappings: ``make_config(cache={"num_blocks": 8})``."""
    base = load_config().to_dict()
    dotted = {k: v for k, v in overrides.items() if "." in k}
    for key, value in overrides.items():
        if "." not in key:
            if isinstance(value, dict):
                base[key].update(value)
            else:
                raise ValueError(f"make_config: {key} must be a section mapping or a dotted key")
    cfg = config_from_dict(base)
    return cfg.replace(dotted) if dotted else cfg


def fake_config(**overrides: Any) -> ClusterConfig:
    """The fake runner with a small pool, in test mode (orchestration and fault tests: fault
    points and forced preemption may be set)."""
    defaults: dict[str, Any] = {
        "testing.enabled": True,
        "model.runner": "fake",
        "model.num_threads": 1,
        "cache.num_blocks": 64,
        "scheduler.max_num_seqs": 8,
        "scheduler.max_num_batched_tokens": 64,
        "scheduler.chunk_size": 16,
    }
    defaults.update(overrides)
    return make_config(**defaults)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy with EOS ignored: a fixed number of tokens, comparable with a reference."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, **kw
    )


def run_until_done(engine: Any, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step an engine until idle; returns the tokens produced per request id."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine not idle after {max_steps} steps")
