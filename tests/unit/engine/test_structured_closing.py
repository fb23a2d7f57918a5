"""Closing the document within the budget (``structured.close_at_budget``): every output of a
constrained request parses and validates, however small its ``max_tokens`` (down to its
schema's shortest document, below which admission refuses it), colocated and through PD, with
and without drafts; outputs the budget never threatened are token-identical to the run without
the feature."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.common.tokenizer import FakeTokenizer
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.structured import GrammarCache, build_vocab
from cluster.engine.structured.closing import Closer
from tests.helpers import fake_config, remote_prefill
from tests.structured_schemas import SCHEMAS
from tests.unit.engine.test_structured import ASCII, SEEDS, _params, _run, check_outputs

SLACK = (0, 1, 3, 8)  # max_tokens = the schema's shortest document + these


def _shortest(engine: LLMEngine, schema: dict[str, Any]) -> int:
    plan = engine.structured.cache.shortest(json.dumps(schema))
    assert plan is not None
    return len(plan)


def _tight(engine: LLMEngine, names: list[str], seeds: list[int | None]) -> dict[str, Any]:
    """Queue every schema x slack x seed at a budget just over its shortest document."""
    schemas: dict[str, Any] = {}
    for name in names:
        base = _shortest(engine, SCHEMAS[name])
        for slack in SLACK:
            for seed in seeds:
                rid = f"{name}/{slack}/{seed}"
                schemas[rid] = SCHEMAS[name]
                params = _params(SCHEMAS[name], seed, max_tokens=base + slack)
                engine.add(EngineRequest(rid, [5, 6, 7, 9 + (seed or 0)], params))
    return schemas


def test_the_closing_of_every_schema_and_of_documents_cut_anywhere_validates() -> None:
    """The closer alone: the shortest document of each schema, and the closing of every prefix
    of a valid document (cut after each of its tokens), parse and validate."""
    vocab = build_vocab(FakeTokenizer(512, 0, ascii_tokens=True), 512)
    cache = GrammarCache(vocab, 1 << 16)
    closer = Closer(vocab)
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        shortest = cache.shortest(text)
        assert shortest is not None, name
        doc = vocab.decode_str(shortest)
        jsonschema.validate(json.loads(doc), schema)
        full = vocab.tokenize_str(doc)
        matcher = cache.matcher(text)
        for i, token in enumerate(full):
            assert matcher.consume_token(token), (name, i)
            if i % 3:
                continue  # every third cut: the test stays quick
            plan = closer.plan(matcher)
            assert plan is not None, (name, i)
            jsonschema.validate(json.loads(vocab.decode_str(full[: i + 1] + plan)), schema)
            assert plan == [] or len(plan) <= len(full) - i - 1 + 8, (name, i, plan)


def test_a_budget_just_over_the_shortest_document_closes_every_output() -> None:
    """max_tokens = the shortest document + 0, 1, 3, 8 on every schema, greedy and 8 seeds at
    temperature 0.8: 100% parse and validate; those the budget closed end ``length``."""
    engine = LLMEngine(fake_config(**{**ASCII, "cache.num_blocks": 1024}))
    schemas = _tight(engine, list(SCHEMAS), [None, *SEEDS])
    got = _run(engine)
    stopped, closed = check_outputs(got, schemas)
    assert stopped + closed == len(got) == len(SCHEMAS) * len(SLACK) * 9
    for rid, (_text, toks, _reason) in got.items():
        name, slack, _seed = rid.split("/")
        assert len(toks) <= _shortest(engine, SCHEMAS[name]) + int(slack), rid
    stats = engine.stats()["structured"]
    assert 0 < stats["num_closed"] <= closed and stats["num_closing_tokens"] > 0
    assert stats["num_closing_lost"] == 0 and stats["num_active"] == 0
    engine.check_integrity()


@pytest.mark.parametrize("spec", ["grammar_drafts", "ngram"])
def test_drafts_stay_within_the_budget_and_change_nothing(spec: str) -> None:
    """Forced-token drafts, or prompt-lookup drafts, at tight budgets: the outputs equal the
    run without drafts (drafts past what the budget allows are cut; verification is exact)."""
    with_drafts = (
        {"decode.speculative.grammar_drafts": True}
        if spec == "grammar_drafts"
        else {"decode.speculative.method": "ngram", "decode.speculative.grammar_drafts": False}
    )
    runs = []
    names = ["long_fixed_keys", "nested_address", "array_of_objects", "recursive_tree"]
    for extra in ({"decode.speculative.grammar_drafts": False}, with_drafts):
        engine = LLMEngine(fake_config(**ASCII, **extra))
        schemas = _tight(engine, names, [None, 1, 2])
        got = _run(engine)
        check_outputs(got, schemas)
        runs.append((got, engine.stats()))
        engine.check_integrity()
    (without, _), (drafted, stats) = runs
    assert {k: v[1:] for k, v in drafted.items()} == {k: v[1:] for k, v in without.items()}
    assert stats["spec"]["num_accepted_tokens"] > 0


def test_outputs_the_budget_never_threatened_are_unchanged() -> None:
    """With and without the closing, at max_tokens 300: every output that ended on its own
    (``stop`` without the feature) is token-identical; with it, all validate."""
    runs = []
    for close in (False, True):
        engine = LLMEngine(fake_config(**ASCII, **{"structured.close_at_budget": close}))
        for name, schema in SCHEMAS.items():
            for seed in [None, *SEEDS]:
                engine.add(
                    EngineRequest(
                        f"{name}/{seed}", [5, 6, 7, 8 + (seed or 0)], _params(schema, seed)
                    )
                )
        runs.append(_run(engine))
        engine.check_integrity()
    off, on = runs
    check_outputs(on, {rid: SCHEMAS[rid.split("/")[0]] for rid in on})
    same = [rid for rid, (_t, _toks, reason) in off.items() if reason == "stop"]
    assert len(same) >= len(off) - 4
    assert {rid: on[rid] for rid in same} == {rid: off[rid] for rid in same}


def test_max_tokens_below_the_shortest_document_is_refused_naming_the_minimum() -> None:
    engine = LLMEngine(fake_config(**ASCII))
    for name in ("person", "long_fixed_keys", "recursive_tree"):
        need = _shortest(engine, SCHEMAS[name])
        with pytest.raises(ValueError, match=rf"max_tokens: {need - 1} .* must be >= {need}"):
            engine.add(
                EngineRequest(name, [1, 2], _params(SCHEMAS[name], None, max_tokens=need - 1))
            )
        engine.add(
            EngineRequest(f"{name}/ok", [1, 2], _params(SCHEMAS[name], None, max_tokens=need))
        )
    assert set(engine.requests) == {"person/ok", "long_fixed_keys/ok", "recursive_tree/ok"}
    got = _run(engine)
    check_outputs(got, {rid: SCHEMAS[rid.split("/")[0]] for rid in got})
    engine.check_integrity()
    off = LLMEngine(fake_config(**ASCII, **{"structured.close_at_budget": False}))
    # cut, as asked
    off.add(EngineRequest("cut", [1, 2], _params(SCHEMAS["person"], None, max_tokens=2)))
    assert _run(off)["cut"][2] == "length"
    off.check_integrity()


@pytest.mark.parametrize("seed", [None, 3, 5])
def test_a_decode_replica_closes_exactly_as_a_colocated_engine(seed: int | None) -> None:
    """PD at a tight budget: the decode replica rebuilds the matcher from the first token and
    closes the document on the same tokens as a colocated run."""
    prompt = [7 + i % 50 for i in range(45)]
    for name in ("array_of_objects", "recursive_tree", "bounded_numbers"):
        local = LLMEngine(fake_config(**ASCII))
        params = _params(SCHEMAS[name], seed, max_tokens=_shortest(local, SCHEMAS[name]) + 2)
        local.add(EngineRequest("x", prompt, params, seed=11))
        expected = _run(local)["x"]
        pre = LLMEngine(fake_config(**ASCII), role="prefill")
        dec = LLMEngine(fake_config(**ASCII), role="decode")
        first = remote_prefill(pre, dec, "x", prompt, params, seed=11)
        rest = _run(dec)["x"]
        assert first.new_token_ids + rest[1] == expected[1], name
        jsonschema.validate(json.loads(expected[0]), SCHEMAS[name])
        for e in (local, pre, dec):
            e.check_integrity()
            assert e.structured.active_ids() == set()


def test_a_closed_output_is_valid_json_with_logprobs_of_the_grammar_s_tokens() -> None:
    """Logprobs on a request the budget closes: one per token, finite (a token the model did
    not sample reads its top-logprob, else -9999.0)."""
    engine = LLMEngine(fake_config(**ASCII))
    schema = SCHEMAS["nested_address"]
    need = _shortest(engine, schema)
    params = SamplingParams(
        temperature=0.8, seed=4, max_tokens=need + 1, json_schema=json.dumps(schema), logprobs=2
    )
    engine.add(EngineRequest("x", [3, 4, 5], params))
    lps: list[float] = []
    toks: list[int] = []
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            lps += o.new_logprobs or []
            toks += o.new_token_ids
            text += o.new_text
    jsonschema.validate(json.loads(text), schema)
    assert len(lps) == len(toks) == need + 1 and all(-9999.0 <= lp <= 0.0 for lp in lps)
    assert engine.stats()["structured"]["num_closing_tokens"] > 0
    engine.check_integrity()


@pytest.mark.parametrize("prompt_len", [32, 21])  # a full last block (forked), a partial one
def test_n_samples_at_a_tight_budget_each_close_as_a_separate_request(prompt_len: int) -> None:
    """n = 4 at max_tokens just over the shortest document: every sample's output validates,
    each is token-identical to a separate request with its seed (its own closing), and the
    shared prompt blocks come back."""
    from cluster.engine.parallel import sample_ids, sample_seed

    names = ["long_fixed_keys", "nested_address", "array_of_objects"]
    prompt = [5 + i % 50 for i in range(prompt_len)]
    alone = LLMEngine(fake_config(**ASCII, **{"cache.enable_prefix_caching": False}))
    engine = LLMEngine(fake_config(**ASCII))
    schemas: dict[str, Any] = {}
    for name in names:
        budget = _shortest(engine, SCHEMAS[name]) + 3
        params = SamplingParams(
            temperature=0.8, max_tokens=budget, json_schema=json.dumps(SCHEMAS[name])
        )
        engine.add(EngineRequest(name, prompt, params, seed=31, n=4))
        for i, rid in enumerate(sample_ids(name, 4)):
            alone.add(EngineRequest(rid, prompt, params, seed=sample_seed(31, i)))
            schemas[rid] = SCHEMAS[name]
    expected, got = _run(alone), _run(engine)
    assert got == expected
    stopped, closed = check_outputs(got, schemas)
    assert stopped + closed == 12 and closed > 0  # the budget closed some of them
    # The samples went their own ways (each closing its own document), not one copied.
    assert all(len({tuple(got[rid][1]) for rid in sample_ids(n, 4)}) > 1 for n in names)
    assert engine.stats()["structured"]["num_active"] == 0
    engine.check_integrity()
    alone.check_integrity()
