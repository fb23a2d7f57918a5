"""Engine and offline-API boundaries: bad input is refused clearly and disturbs nobody."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.common.protocol import FirstToken
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.request import RequestStatus
from tests.helpers import fake_config, greedy, run_until_done


def test_a_bad_request_never_disturbs_the_batch() -> None:
    ref_eng = LLMEngine(fake_config())
    ref_eng.add(EngineRequest("good", [5, 6, 7, 8, 9], greedy(10)))
    expected = run_until_done(ref_eng)["good"]

    eng = LLMEngine(fake_config(**{"model.max_model_len": 64}))
    eng.add(EngineRequest("good", [5, 6, 7, 8, 9], greedy(10)))
    first = [t for o in eng.step() for t in o.new_token_ids]
    bad = [
        ([], greedy(4), "prompt"),
        (list(range(1, 65)), greedy(4), "prompt"),
        (list(range(1, 60)), greedy(10), "max_tokens"),
        ([1, 2, 99999], greedy(4), "prompt_token_ids"),
    ]
    for i, (prompt, params, field) in enumerate(bad):
        with pytest.raises(ValueError, match=rf"^{field}:"):
            eng.add(EngineRequest(f"bad{i}", prompt, params))
    with pytest.raises(ValueError, match="^request_id: 'good' already exists"):
        eng.add(EngineRequest("good", [1, 2], greedy(2)))
    with pytest.raises(ValueError, match="^max_tokens: .*KV blocks"):
        LLMEngine(fake_config(**{"cache.num_blocks": 2})).add(
            EngineRequest("x", [1] * 30, greedy(10))
        )
    assert first + run_until_done(eng)["good"] == expected
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_stop_conditions() -> None:
    eng = LLMEngine(fake_config())
    eng.add(EngineRequest("a", [5, 6, 7], greedy(10)))
    tokens = run_until_done(eng)["a"]
    eng.add(
        EngineRequest(
            "b", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[3]])
        )
    )
    eng.add(EngineRequest("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3)))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    b_tokens = [t for o in outs["b"] for t in o.new_token_ids]
    assert b_tokens == tokens[: tokens.index(tokens[3]) + 1]
    assert outs["b"][-1].finish_reason == "stop"
    assert outs["c"][-1].finish_reason == "length" and len(outs["c"]) == 3
    eng.check_integrity()


def test_offline_llm_api(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_blocks=256, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=5)
    (a,) = llm.generate("The quick brown fox", params)
    (b,) = llm.generate(llm.tokenizer.encode("The quick brown fox"), params)
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 5 and a.finish_reason
    assert a.text == llm.tokenizer.decode(a.token_ids)
    outs = llm.generate(["one", "two, three"], [params, SamplingParams(max_tokens=2, seed=1)])
    assert len(outs) == 2
    (c,) = llm.chat([{"role": "user", "content": "hi"}], params)
    assert c.prompt_token_ids[0] == llm.tokenizer.token_to_id("<|im_start|>")
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate(["fine", ""], params)
    with pytest.raises(ValueError, match="params: 1 given for 2 prompts"):
        llm.generate(["a", "b"], [params])
    with pytest.raises(ValueError, match="^blok_size: unknown engine option"):
        LLM(str(tiny_model_dir), blok_size=3)
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
    streamed = "".join(o.new_text for o in llm.stream("The quick brown fox", params))
    assert streamed == a.text


def _remote(eng: LLMEngine, rid: str, params: SamplingParams, n: int = 1) -> None:
    """A remote request on a decode-role engine, its blocks reserved (the KV never written:
    these tests end it before it would decode)."""
    assert eng.add(EngineRequest(rid, list(range(1, 41)), params, prefill="remote", n=n)).remote
    assert [r.request_id for r in eng.take_reservations()] == [rid]


def test_the_request_table_says_who_holds_each_request() -> None:
    """One table, keyed by status: the scheduler's queues, the hand-off awaiting KV, the sample
    groups. The integrity check finds a request its status misplaces, or one gone missing."""
    eng = LLMEngine(fake_config(**{"decode.local_prefill_threshold": 8}), role="decode")
    eng.add(EngineRequest("run", [5, 6, 7], greedy(30)))
    eng.step()
    eng.add(EngineRequest("wait", [5, 6, 7, 8], greedy(4)))
    _remote(eng, "far", _sampled(4), n=3)
    status = {rid: r.status.name for rid, r in eng.requests.items()}
    assert status == {
        "run": "RUNNING",
        "wait": "WAITING",
        "far": "WAITING_FOR_KV",
        "far#1": "WAITING_FOR_LEADER",
        "far#2": "WAITING_FOR_LEADER",
    }
    eng.check_integrity()
    eng.requests["wait"].status = RequestStatus.WAITING_FOR_KV  # the scheduler holds it
    with pytest.raises(AssertionError, match="disagree on: \\['wait'\\]"):
        eng.check_integrity()
    eng.requests["wait"].status = RequestStatus.WAITING
    lost = eng.requests["far#1"]
    eng.samples.remove(lost)  # gone from its holder, still in the table
    with pytest.raises(AssertionError, match="far#1"):
        eng.check_integrity()
    eng.samples._pending["far"].insert(0, lost)
    eng.check_integrity()
    for rid in ("run", "wait", "far"):
        assert eng.abort_request(rid)
    eng.step()
    eng.check_integrity()
    assert eng.requests == {} and eng.block_manager.num_used_blocks == 0


def _sampled(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=3, **kw)  # type: ignore[arg-type]


def test_kv_arrived_refuses_bad_first_tokens_and_changes_nothing() -> None:
    eng = LLMEngine(fake_config(), role="decode")
    _remote(eng, "x", greedy(4), n=2)
    bad = [
        ("nope", [FirstToken(7, " t7")], "not waiting for KV"),
        ("x", [], "no first token"),
        ("x", [FirstToken(7, " t7"), FirstToken(99999, "")], "outside the vocabulary"),
        ("x", [FirstToken(7, " t7")] * 3, "'x#2': not in this engine"),
    ]
    for rid, tokens, message in bad:
        with pytest.raises(ValueError, match=message):
            eng.kv_arrived(rid, tokens)
    assert all(not r.output_token_ids for r in eng.requests.values())
    eng.check_integrity()
    assert eng.abort_request("x")
    eng.step()
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_a_first_token_that_ends_its_request_ends_it_quietly_at_kv_arrived() -> None:
    """The client has the end from the prefill reply: the engine ends the request (blocks
    freed, counted finished, not aborted) with no output, and says so."""
    eng = LLMEngine(fake_config(), role="decode")
    _remote(eng, "x", greedy(1))
    assert eng.kv_arrived("x", [FirstToken(7, " t7", finish_reason="length")]) == ["x"]
    assert eng.step() == [] and eng.requests == {}
    assert (eng.counters.num_finished, eng.counters.num_aborted) == (1, 0)
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_first_tokens_the_engines_disagree_on_end_with_what_the_client_lacks() -> None:
    """Never expected (both engines run the same code on the same token). An end the prefill
    replica saw and this engine does not fails the request (its KV was never pulled); an end
    only this engine sees goes out as a last output with nothing sent twice."""
    eng = LLMEngine(fake_config(), role="decode")
    _remote(eng, "a", SamplingParams(temperature=0.0, max_tokens=8))
    assert eng.kv_arrived("a", [FirstToken(7, " t7", finish_reason="stop")]) == []
    (failed,) = eng.step()
    assert (failed.finish_reason, failed.new_token_ids) == ("error", [])
    assert "disagree on the first token" in (failed.error or "")

    _remote(eng, "b", SamplingParams(temperature=0.0, max_tokens=8, stop=(" t7",)))
    # The prefill replica said " t" and going on; here " t7" is the stop string: the end
    # goes out, without the text already sent, with no token again.
    assert eng.kv_arrived("b", [FirstToken(7, " t")]) == []
    (ended,) = eng.step()
    assert (ended.new_token_ids, ended.new_text, ended.finish_reason) == ([], "", "stop")
    assert eng.requests == {}
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
