"""Live migration in the engine: ``migrate_out`` pauses a decoding request and exports it,
``add(resume=...)`` + ``kv_arrived`` take it over on another decode-role engine, and the whole
output equals an undisturbed run (greedy, seeded sampling, structured output, speculation).
``migration_ended(moved=False)`` lets the source decode on, as if nothing happened."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine, MigrationExport
from cluster.engine.request import RequestStatus, Resume
from tests.helpers import fake_config, tiny_config
from tests.structured_schemas import SCHEMAS

ASCII = {"testing.fake_model.ascii_tokens": True, "cache.num_blocks": 256}
PROMPT = [7 + i % 50 for i in range(37)]


TEXT: dict[int, str] = {}  # id(engine) -> the text streamed for "r" (tokens and text checked)


def _drain(engine: LLMEngine, rid: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                TEXT[id(engine)] = TEXT.get(id(engine), "") + o.new_text
    return tokens


def _until(engine: LLMEngine, rid: str, num_tokens: int) -> list[int]:
    """Step until ``rid`` has at least ``num_tokens`` outputs (it must not finish before)."""
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        for o in engine.step():
            if o.request_id == rid:
                assert not o.finished, (o.finish_reason, tokens)
                tokens += o.new_token_ids
                TEXT[id(engine)] = TEXT.get(id(engine), "") + o.new_text
    return tokens


def _take_over(src: LLMEngine, dst: LLMEngine, ex: MigrationExport, params: Any) -> None:
    """What the decode replicas do around the wire: the target adds the request with its
    outputs, reserves blocks, the KV is copied (the cached leading blocks are not), arrival."""
    resume = Resume(ex.output_token_ids, ex.num_draft_tokens, ex.num_accepted_tokens, ex.spec_track)
    dst.add(
        EngineRequest(ex.request_id, ex.prompt_token_ids, params, "remote", ex.seed, resume=resume)
    )
    (res,) = dst.take_reservations()
    k = res.num_hit_blocks
    n = len(ex.block_ids)
    dst.runner.kv_cache[res.block_ids[k:n]] = src.runner.kv_cache[list(ex.block_ids[k:])]
    assert dst.kv_arrived(ex.request_id, ()) == []
    assert src.migration_ended(ex.request_id, moved=True)


def _params(case: str) -> SamplingParams:
    if case == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    if case == "seeded":
        return SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)
    return SamplingParams(
        temperature=0.8, seed=5, max_tokens=120, json_schema=json.dumps(SCHEMAS["person"])
    )


CASES = [("greedy", "none"), ("seeded", "none"), ("structured", "none"), ("greedy", "ngram")]


@pytest.mark.parametrize(("case", "spec"), CASES)
@pytest.mark.parametrize("after", [1, 9, 16])
def test_fake_model_migration_equals_an_undisturbed_run(case: str, spec: str, after: int) -> None:
    over = {**ASCII, "decode.speculative.method": spec}
    params = _params(case)
    TEXT.clear()
    local = LLMEngine(fake_config(**over), role="decode")
    local.add(EngineRequest("r", PROMPT, params, seed=11))
    expected = _drain(local, "r")
    src = LLMEngine(fake_config(**over), role="decode")
    dst = LLMEngine(fake_config(**over), role="decode")
    # a busy source: another request decodes beside it, before and after the migration
    src.add(EngineRequest("other", PROMPT[:20], _params("greedy"), seed=2))
    src.add(EngineRequest("r", PROMPT, params, seed=11))
    head = _until(src, "r", after)
    ex = src.migrate_out("r")
    assert ex is not None and ex.output_token_ids == tuple(head)
    assert ex.num_kv_tokens == len(PROMPT) + len(head) - 1
    assert src.requests["r"].status == RequestStatus.MIGRATING
    src.check_integrity()
    _take_over(src, dst, ex, params)
    assert "r" not in src.requests
    assert head + _drain(dst, "r") == expected, (case, spec, after)
    assert TEXT.pop(id(src)) + TEXT.pop(id(dst)) == TEXT.pop(id(local))
    _drain(src, "other")
    for e in (local, src, dst):
        e.check_integrity()
        assert not e.requests and e.structured.active_ids() == set()
    assert src.stats()["num_migrated_out"] == 1 and dst.stats()["num_migrated_in"] == 1


def test_a_migration_not_taken_resumes_on_the_source_unchanged() -> None:
    params = _params("seeded")
    local = LLMEngine(fake_config(**ASCII), role="decode")
    local.add(EngineRequest("r", PROMPT, params, seed=11))
    expected = _drain(local, "r")
    src = LLMEngine(fake_config(**ASCII), role="decode")
    src.add(EngineRequest("r", PROMPT, params, seed=11))
    head = _until(src, "r", 5)
    assert src.migrate_out("r") is not None
    assert src.step() == []  # paused: no step for it, no output
    assert src.migrate_out("r") is None  # already migrating
    assert src.migration_ended("r", moved=False)
    assert not src.migration_ended("r", moved=False)
    assert head + _drain(src, "r") == expected
    src.check_integrity()
    assert src.stats()["num_migrations_resumed"] == 1


def test_an_abort_while_migrating_frees_everything() -> None:
    src = LLMEngine(fake_config(**ASCII), role="decode")
    src.add(EngineRequest("r", PROMPT, _params("greedy"), seed=1))
    _until(src, "r", 3)
    assert src.migrate_out("r") is not None
    assert src.abort_request("r")
    (out,) = src.step()
    assert out.finished and out.finish_reason == "abort"
    assert not src.migration_ended("r", moved=True)
    src.check_integrity()
    assert src.block_manager.num_free_blocks == 256  # (cached blocks count as free)


def test_what_cannot_migrate_is_refused() -> None:
    src = LLMEngine(fake_config(**ASCII), role="decode")
    assert src.migrate_out("nope") is None
    src.add(EngineRequest("queued", PROMPT, _params("greedy"), seed=1))
    assert src.migrate_out("queued") is None  # not decoding yet
    src.add(EngineRequest("n2", PROMPT, _params("seeded"), seed=1, n=2))
    _until(src, "n2", 2)
    assert src.migrate_out("n2") is None  # several samples stay where they are
    colo = LLMEngine(fake_config(**ASCII))
    with pytest.raises(ValueError, match="decode role"):
        colo.migrate_out("x")
    dst = LLMEngine(fake_config(**ASCII), role="decode")
    bad: dict[str, dict[str, Any]] = {
        "decode role, remote": dict(prefill="local", resume=Resume([1, 2])),
        "single-sample": dict(prefill="remote", n=2, resume=Resume([1, 2])),
        "nothing of max_tokens": dict(prefill="remote", resume=Resume([1] * 40)),
        "outside the vocabulary": dict(prefill="remote", resume=Resume([10**9])),
        "has output tokens": dict(prefill="remote", resume=Resume([])),
        "not an acceptance history": dict(
            prefill="remote", resume=Resume([1], spec_track=(2.0, 1.0, 0, 0))
        ),
    }
    for phrase, kw in bad.items():
        with pytest.raises(ValueError, match=phrase):
            dst.add(EngineRequest("m", PROMPT, _params("greedy"), seed=1, **kw))
    assert not dst.requests
    dst.check_integrity()
    for e in (src, colo):
        for rid in list(e.requests):
            e.abort_request(rid)
        e.step()
        e.check_integrity()


def test_the_target_reuses_its_cached_prefix(tiny_model_dir: Path) -> None:
    """Real model (greedy and seeded): the prompt's blocks the target already caches are not
    copied, and the output equals an undisturbed run."""
    over = {"cache.num_blocks": 64}
    for params in (_params("greedy"), _params("seeded")):
        local = LLMEngine(tiny_config(tiny_model_dir, **over), role="decode")
        local.add(EngineRequest("r", PROMPT, params, seed=11))
        expected = _drain(local, "r")
        src = LLMEngine(tiny_config(tiny_model_dir, **over), role="decode")
        dst = LLMEngine(tiny_config(tiny_model_dir, **over), role="decode")
        dst.add(EngineRequest("warm", [*PROMPT, 3], _params("greedy"), seed=1))
        _drain(dst, "warm")  # the prompt's full blocks are now cached on the target
        src.add(EngineRequest("r", PROMPT, params, seed=11))
        head = _until(src, "r", 6)
        ex = src.migrate_out("r")
        assert ex is not None
        _take_over(src, dst, ex, params)
        assert dst.requests["r"].num_cached_tokens >= len(PROMPT) // 16 * 16
        assert head + _drain(dst, "r") == expected
        for e in (local, src, dst):
            e.check_integrity()
