"""Grammar-constrained decoding (``cluster.engine.structured``, llguidance) in the engine.

The fake model's logits are random-ish (a function of the KV it reads back), so its outputs are
JSON only because the mask forces them to be. Every output must parse and validate against its
schema, those that end ``length`` too: near the end of the budget the engine closes the
document (``structured.close_at_budget``; the fake model's greedy argmax can spin in an endless
fraction of zeros, which the closing ends). ``test_structured_closing.py`` forces the budget.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.common.tokenizer import Tokenizer
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.structured import build_vocab
from tests.helpers import fake_config, make_config, remote_prefill
from tests.structured_schemas import BAD_SCHEMAS, SCHEMAS

ASCII = {"testing.fake_model.ascii_tokens": True, "cache.num_blocks": 512}
SEEDS = range(8)


def _params(schema: dict[str, Any], seed: int | None, max_tokens: int = 300) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 0.8,
        seed=seed,
        max_tokens=max_tokens,
        json_schema=json.dumps(schema),
    )


def _run(engine: LLMEngine) -> dict[str, tuple[str, list[int], str | None]]:
    """Step until idle: request id -> (text, tokens, finish reason)."""
    got: dict[str, tuple[str, list[int], str | None]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            text, toks, _ = got.get(o.request_id, ("", [], None))
            got[o.request_id] = (text + o.new_text, toks + o.new_token_ids, o.finish_reason)
    return got


def check_outputs(
    got: dict[str, tuple[str, list[int], str | None]], schemas: dict[str, dict[str, Any]]
) -> tuple[int, int]:
    """Every output, ``stop`` or ``length``, parses and validates against its schema; returns
    (ended by the grammar: ``stop``, ended by the budget: ``length``)."""
    stopped = closed = 0
    for rid, (text, _toks, reason) in got.items():
        assert reason in ("stop", "length"), (rid, reason, text)
        try:
            jsonschema.validate(json.loads(text), schemas[rid])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{rid} ({reason}): {text!r}: {e}") from None
        stopped += reason == "stop"
        closed += reason == "length"
    return stopped, closed


def test_every_schema_greedy_and_sampled_validates_on_the_fake_model() -> None:
    engine = LLMEngine(fake_config(**ASCII))
    schemas: dict[str, dict[str, Any]] = {}
    for name, schema in SCHEMAS.items():
        for seed in [None, *SEEDS]:
            rid = f"{name}/{seed}"
            schemas[rid] = schema
            engine.add(EngineRequest(rid, [5, 6, 7, 8 + (seed or 0)], _params(schema, seed)))
    got = _run(engine)
    stopped, closed = check_outputs(got, schemas)  # 100%: every one parses and validates
    assert len(SCHEMAS) >= 12 and stopped + closed == len(got) == len(SCHEMAS) * 9
    stats = engine.stats()["structured"]
    assert stats["num_closing_lost"] == 0
    assert stats["num_active"] == 0 and stats["num_compiled"] == len(SCHEMAS)
    engine.check_integrity()


def test_forced_tokens_as_drafts_change_nothing_but_the_step_count() -> None:
    """Greedy and seeded outputs with the grammar's forced tokens proposed as drafts equal the
    run without (verification is exact), in fewer steps."""
    runs = []
    for drafts in (True, False):
        engine = LLMEngine(fake_config(**ASCII, **{"decode.speculative.grammar_drafts": drafts}))
        for name in ("long_fixed_keys", "nested_address", "union_shapes"):
            for seed in (None, 3):
                engine.add(EngineRequest(f"{name}/{seed}", [9, 8, 7], _params(SCHEMAS[name], seed)))
        got = _run(engine)
        runs.append((got, engine.counters.num_steps, engine.stats()))
        engine.check_integrity()
    (with_drafts, steps_with, stats_with), (without, steps_without, stats_without) = runs
    assert {k: v[1] for k, v in with_drafts.items()} == {k: v[1] for k, v in without.items()}
    assert stats_with["structured"]["num_forced_drafts"] > 0
    assert stats_without["structured"]["num_forced_drafts"] == 0
    assert stats_with["spec"]["num_accepted_tokens"] > 0
    assert steps_with < steps_without * 0.8, (steps_with, steps_without)


def test_prompt_lookup_drafts_are_cut_where_the_grammar_refuses() -> None:
    """ngram drafts on a constrained request: outputs equal the run without speculation."""
    spec = {"decode.speculative.method": "ngram", "decode.speculative.grammar_drafts": False}
    runs = []
    for extra in ({}, spec):
        engine = LLMEngine(fake_config(**ASCII, **extra))
        # A prompt that spells JSON, so prompt lookup proposes JSON-looking and other drafts.
        prompt = [ord(c) for c in '{"code":"ABC-123","tags":["x"]} {"code":"AB'] + [300, 301]
        for seed in (None, 1, 2):
            engine.add(EngineRequest(f"r{seed}", prompt, _params(SCHEMAS["pattern_codes"], seed)))
        runs.append(_run(engine))
        engine.check_integrity()
    assert {k: v[1] for k, v in runs[0].items()} == {k: v[1] for k, v in runs[1].items()}
    check_outputs(runs[1], dict.fromkeys(runs[1], SCHEMAS["pattern_codes"]))


def test_prefill_replica_constrains_the_first_token_decode_replica_replays_it() -> None:
    """PD: only the schema and the tokens cross; the decode engine's matcher is rebuilt from
    the first token, and the result equals a colocated run."""
    schema = SCHEMAS["array_of_objects"]
    prompt = [7 + i % 50 for i in range(45)]
    for seed in (None, 5):
        local = LLMEngine(fake_config(**ASCII))
        local.add(EngineRequest("x", prompt, _params(schema, seed), seed=11))
        expected = _run(local)["x"]
        pre = LLMEngine(fake_config(**ASCII), role="prefill")
        dec = LLMEngine(fake_config(**ASCII), role="decode")
        first = remote_prefill(pre, dec, "x", prompt, _params(schema, seed), seed=11)
        assert pre.structured.active_ids() == set()
        rest = _run(dec)["x"]
        assert first.new_token_ids + rest[1] == expected[1]
        assert rest[2] == "stop"
        jsonschema.validate(json.loads(expected[0]), schema)
        for e in (local, pre, dec):
            e.check_integrity()
            assert e.structured.active_ids() == set()


def test_bad_schemas_are_refused_naming_the_problem_and_nothing_is_held() -> None:
    engine = LLMEngine(fake_config(**ASCII, **{"router.max_json_schema_bytes": 4096}))
    for name, (text, phrase) in BAD_SCHEMAS.items():
        with pytest.raises(ValueError, match="json_schema") as e:
            engine.add(EngineRequest(name, [1, 2], SamplingParams(json_schema=text)))
        assert phrase in str(e.value), (name, str(e.value))
    big = json.dumps({"enum": [f"value-{i}" for i in range(1000)]})
    too_big = r"json_schema: the schema is \d+ bytes, over the limit of 4096 bytes"
    with pytest.raises(ValueError, match=too_big):
        engine.add(EngineRequest("big", [1, 2], SamplingParams(json_schema=big)))
    assert not engine.requests and engine.structured.active_ids() == set()
    engine.check_integrity()


def test_abort_mid_stream_frees_the_matcher() -> None:
    engine = LLMEngine(fake_config(**ASCII))
    engine.add(EngineRequest("a", [3, 4, 5], _params(SCHEMAS["array_of_objects"], 1)))
    engine.add(EngineRequest("b", [3, 4, 6], _params(SCHEMAS["person"], None)))
    engine.step()
    engine.step()
    assert engine.structured.active_ids() == {"a", "b"}
    engine.abort_request("a")
    assert engine.structured.active_ids() == {"b"}
    got = _run(engine)
    assert got["a"][2] == "abort" and got["b"][2] == "stop"
    assert engine.structured.active_ids() == set()
    engine.check_integrity()


def test_json_mode_on_a_vocabulary_that_cannot_spell_json_ends_with_eos() -> None:
    """The default fake vocabulary (every token reads `` t<id>``) has no ``{``: the grammar
    allows no token, so EOS ends the request at once instead of sampling from nothing."""
    engine = LLMEngine(fake_config())
    engine.add(
        EngineRequest("x", [3, 4], SamplingParams(max_tokens=20, json_schema='{"type":"object"}'))
    )
    got = _run(engine)
    assert got["x"][1] == [0] and got["x"][2] == "stop"
    engine.check_integrity()


def test_the_tiny_llama_tokenizer_builds_a_vocabulary_and_constrains(
    tiny_model_dir: Path,
) -> None:
    vocab = build_vocab(Tokenizer(tiny_model_dir), 512)
    assert vocab.vocab_size == 512
    engine = LLMEngine(
        make_config(
            **{"model.path": str(tiny_model_dir), "model.num_threads": 1, "cache.num_blocks": 256}
        )
    )
    schemas: dict[str, dict[str, Any]] = {}
    for name in ("person", "enums", "recursive_tree", "long_fixed_keys"):
        for seed in (None, 0, 1):
            rid = f"{name}/{seed}"
            schemas[rid] = SCHEMAS[name]
            engine.add(
                EngineRequest(
                    rid, engine.tokenizer.encode("Answer in JSON: "), _params(SCHEMAS[name], seed)
                )
            )
    got = _run(engine)
    stopped, closed = check_outputs(got, schemas)  # every one, closed by the budget or not
    assert stopped + closed == len(schemas)
    engine.check_integrity()


def test_a_fake_word_tokenizes_back_to_its_id() -> None:
    """The fake vocabulary's canonical tokenization (forced tokens are tokenized with it)."""
    from cluster.common.tokenizer import FakeTokenizer

    vocab = build_vocab(FakeTokenizer(512, 0, ascii_tokens=True), 512)
    assert vocab.tokenize_str('{"a": t300}') == [ord(c) for c in '{"a":'] + [300, ord("}")]
    assert isinstance(vocab, llguidance.LLTokenizer)


def test_preemption_by_recompute_keeps_the_grammar_state() -> None:
    """Forced preemption every few steps: the matcher's state is the accepted tokens', so the
    recomputed requests produce exactly what an undisturbed run does."""
    runs = []
    for extra in ({}, {"testing.force_preempt_interval": 3}):
        engine = LLMEngine(fake_config(**ASCII, **extra))
        for i, name in enumerate(("nested_address", "array_of_objects", "union_shapes")):
            engine.add(EngineRequest(name, [4 + i, 5, 6], _params(SCHEMAS[name], i)))
        runs.append(_run(engine))
        if extra:
            assert engine.scheduler.num_preemptions > 0
        engine.check_integrity()
    assert runs[0] == runs[1]
    check_outputs(runs[1], {name: SCHEMAS[name] for name in runs[1]})


def test_n_samples_of_a_full_last_block_each_follow_the_grammar() -> None:
    """n = 4 on a 32-token prompt: the samples' first tokens are drawn from the leader's masked
    row (``parallel``), each matcher then advances on its own; a separate seeded request per
    sample gives the same outputs."""
    from cluster.engine.parallel import sample_ids, sample_seed

    name, schema = next(iter(SCHEMAS.items()))
    prompt = [5 + i % 50 for i in range(32)]
    params = SamplingParams(temperature=0.8, max_tokens=200, json_schema=json.dumps(schema))
    alone = LLMEngine(fake_config(**ASCII, **{"cache.enable_prefix_caching": False}))
    for i in range(4):
        alone.add(EngineRequest(f"a{i}", prompt, params, seed=sample_seed(21, i)))
    expected = _run(alone)
    engine = LLMEngine(fake_config(**ASCII))
    engine.add(EngineRequest("r", prompt, params, seed=21, n=4))
    got = _run(engine)
    assert [got[rid] for rid in sample_ids("r", 4)] == [expected[f"a{i}"] for i in range(4)]
    valid, cut = check_outputs(got, dict.fromkeys(got, schema))
    assert valid + cut == 4, name
    engine.check_integrity()
