"""Structured output on the real default model (SmolLM2-135M), offline: every schema of the
acceptance set, greedy and seeded at temperature 0.8, parses and validates: all of them, those
that end ``length`` too. The 135M model nests the recursive schema without end and once wrote
9.999... for a bounded number (4 of 36 were cut mid-JSON at 256 tokens before the engine closed
documents within the budget, ``structured.close_at_budget``); now the engine closes them: they
end ``length`` and validate. CI runs greedy + 1 seed; the full 8 seeds run nightly. The
forced-token drafts are checked exact on the real model too: greedy outputs with and without
them are identical."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import make_config
from tests.structured_schemas import SCHEMAS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAX_TOKENS = 256


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    base: dict[str, Any] = {
        "model.path": str(model_dir),
        "model.num_threads": 2,
        "scheduler.max_num_seqs": 16,
        "scheduler.max_num_batched_tokens": 1024,
        "cache.memory_bytes": 512 << 20,
    }
    base.update(overrides)
    return LLMEngine(make_config(**base))


def _run(
    engine: LLMEngine, seeds: list[int | None], slack: int | None = None
) -> dict[str, tuple[str, list[int], str]]:
    """slack: max_tokens = the schema's shortest document + slack (None: MAX_TOKENS)."""
    tok = engine.tokenizer
    for name, schema in SCHEMAS.items():
        question = f"Reply with one JSON object for this JSON Schema:\n{json.dumps(schema)}"
        prompt = tok.encode_chat([{"role": "user", "content": question}])
        for seed in seeds:
            params = SamplingParams(
                temperature=0.0 if seed is None else 0.8,
                seed=seed,
                max_tokens=MAX_TOKENS if slack is None else _shortest(engine, schema) + slack,
                json_schema=json.dumps(schema),
            )
            engine.add(EngineRequest(f"{name}/{seed}", prompt, params))
    got: dict[str, tuple[str, list[int], str]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            text, toks, _ = got.get(o.request_id, ("", [], ""))
            got[o.request_id] = (text + o.new_text, toks + o.new_token_ids, o.finish_reason or "")
    engine.check_integrity()
    assert engine.structured.active_ids() == set()
    return got


def _shortest(engine: LLMEngine, schema: dict[str, Any]) -> int:
    return len(engine.structured.cache.shortest(json.dumps(schema)) or [])


def _check(engine: LLMEngine, got: dict[str, tuple[str, list[int], str]]) -> None:
    """100%: every output parses and validates, ``stop`` or ``length`` (closed in budget)."""
    for rid, (text, _toks, reason) in got.items():
        assert reason in ("stop", "length"), (rid, reason, text)
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[rid.split("/")[0]])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{rid} ({reason}): {text!r}: {e}") from None
    assert engine.stats()["structured"]["num_closing_lost"] == 0


def test_schemas_validate_greedy_and_one_seed(real_model_dir: Path) -> None:
    engine = _engine(real_model_dir)
    _check(engine, _run(engine, [None, 0]))


def test_tight_budgets_close_every_output_on_the_real_model(real_model_dir: Path) -> None:
    """max_tokens = each schema's shortest document + 4 (greedy, one seed): all validate."""
    engine = _engine(real_model_dir)
    got = _run(engine, [None, 0], slack=4)
    _check(engine, got)
    assert engine.stats()["structured"]["num_closed"] > 0


@pytest.mark.nightly
def test_schemas_validate_greedy_and_eight_seeds(real_model_dir: Path) -> None:
    engine = _engine(real_model_dir)
    _check(engine, _run(engine, [None, *range(8)]))


def test_forced_drafts_are_exact_on_the_real_model(real_model_dir: Path) -> None:
    """Greedy, each schema's shortest document + 32 tokens: free text, forced runs, and the
    budget's closing (forced too) in every output; identical with and without the drafts."""
    on = _engine(real_model_dir)
    with_drafts = _run(on, [None], slack=32)
    off = _engine(real_model_dir, **{"decode.speculative.grammar_drafts": False})
    without = _run(off, [None], slack=32)
    assert on.stats()["structured"]["num_forced_drafts"] > 0
    assert off.stats()["structured"]["num_forced_drafts"] == 0
    assert {k: v[1] for k, v in with_drafts.items()} == {k: v[1] for k, v in without.items()}
