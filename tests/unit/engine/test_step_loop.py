"""The engine step loop thread: concurrent callers, sinks, aborts, and a step that raises."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from cluster.common.protocol import FirstToken
from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput
from cluster.engine.step_loop import EngineDeadError, EngineLoop
from tests.helpers import fake_config, greedy, run_until_done


def _collect() -> tuple[list[RequestOutput], threading.Event, object]:
    outs: list[RequestOutput] = []
    done = threading.Event()

    def sink(o: RequestOutput) -> None:
        outs.append(o)
        if o.finished:
            done.set()

    return outs, done, sink


def test_concurrent_requests_stream_exact_outputs() -> None:
    prompts = {f"r{i}": [1 + (i * 31 + j * 7) % 500 for j in range(10 + i)] for i in range(6)}
    ref_engine = LLMEngine(fake_config())
    for rid, p in prompts.items():
        ref_engine.add(EngineRequest(rid, p, greedy(12)))
    expected = run_until_done(ref_engine)

    loop = EngineLoop(LLMEngine(fake_config())).start()
    results = {}
    events = []
    for rid, p in prompts.items():
        outs, done, sink = _collect()
        results[rid] = outs
        events.append(done)
        threading.Thread(
            target=lambda rid=rid, p=p, sink=sink: loop.add(
                EngineRequest(rid, p, greedy(12)), sink
            ).result()
        ).start()
    for e in events:
        assert e.wait(10)
    for rid, outs in results.items():
        assert [t for o in outs for t in o.new_token_ids] == expected[rid]
    assert loop.call(lambda eng: eng.check_integrity()).result(5) is None
    assert loop.stats()["kv"]["num_used_blocks"] == 0 and loop.is_alive()
    loop.stop()


def test_bad_request_raises_to_the_caller_and_the_loop_keeps_serving() -> None:
    loop = EngineLoop(LLMEngine(fake_config())).start()
    with pytest.raises(ValueError, match="^prompt:"):
        loop.add(EngineRequest("bad", [], greedy(4)), lambda o: None).result(5)
    outs, done, sink = _collect()
    loop.add(EngineRequest("ok", [3, 4, 5], greedy(4)), sink).result(5)
    assert done.wait(10) and outs[-1].finish_reason == "length"
    loop.stop()


def test_abort_frees_blocks() -> None:
    loop = EngineLoop(LLMEngine(fake_config(**{"testing.fake_model.decode_delay_s": 0.01}))).start()
    outs, done, sink = _collect()
    loop.add(EngineRequest("long", [3, 4, 5], greedy(500)), sink).result(5)
    assert loop.abort("long").result(5)
    assert done.wait(5) and outs[-1].finish_reason == "abort"
    loop.call(lambda eng: eng.check_integrity()).result(5)
    assert loop.call(lambda eng: eng.block_manager.num_used_blocks).result(5) == 0
    loop.stop()


def test_a_raising_step_fails_in_flight_requests_and_marks_the_loop_dead() -> None:
    calls = {"n": 0}

    def boom() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")

    loop = EngineLoop(LLMEngine(fake_config()), before_step=boom).start()
    outs, done, sink = _collect()
    loop.add(EngineRequest("r", [3, 4, 5], greedy(50)), sink).result(5)
    assert done.wait(5)
    assert outs[-1].finish_reason == "error" and "injected fault" in (outs[-1].error or "")
    assert not loop.is_alive()
    fut: Future[None] = loop.call(lambda eng: None)
    with pytest.raises(EngineDeadError):
        fut.result(5)
    loop.stop()


def test_requests_ended_without_an_output_leave_no_sink_behind() -> None:
    """``kv_arrived`` with first tokens that end samples (the client has their ends from the
    prefill reply): no output goes to the sink for them, and their sinks go with them; the
    sample that goes on still streams to its own."""
    loop = EngineLoop(LLMEngine(fake_config(), role="decode")).start()
    try:
        outs, _done, sink = _collect()
        params = greedy(1)
        request = EngineRequest("x", list(range(1, 33)), params, prefill="remote", n=2)
        assert loop.add(request, sink).result(5).remote  # type: ignore[arg-type]
        assert set(loop._sinks) == {"x", "x#1"}
        ends = [FirstToken(7, " t7", finish_reason="length")] * 2
        ended = loop.call_ending(lambda eng: eng.kv_arrived("x", ends)).result(5)
        assert ended == ["x", "x#1"] and loop._sinks == {} and outs == []
        loop.call(lambda eng: eng.check_integrity()).result(5)
        assert loop.call(lambda eng: eng.block_manager.num_used_blocks).result(5) == 0
    finally:
        loop.stop()
