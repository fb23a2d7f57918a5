"""``EngineClient.add`` cancelled at each moment of its round trip to the engine thread: whatever
the moment, a request the engine admitted is aborted and its blocks freed, and a request the
engine never admitted (or refused as a duplicate) leaves nothing and touches nobody else's.

The leak this pins: a stream cancelled (client gone) after the engine thread admitted the
request but before the event loop resumed the caller; the caller never learned it was in the
engine, so nothing aborted it and its blocks stayed held (reliability matrix F9, the abort storm).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cluster.engine.client import EngineClient
from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput
from tests.helpers import fake_config, greedy

pytestmark = pytest.mark.timeout(60)

PROMPT = [3 + j % 400 for j in range(40)]


def _client() -> EngineClient:
    config = fake_config(**{"testing.fake_model.decode_delay_s": 0.005})
    return EngineClient(LLMEngine(config)).start()


def _engine_state(client: EngineClient) -> tuple[list[str], int]:
    def read(eng: LLMEngine) -> tuple[list[str], int]:
        eng.check_integrity()
        return sorted(eng.requests), eng.block_manager.num_used_blocks

    result: tuple[list[str], int] = client._loop.call(read).result(10)
    return result


def _sink(outs: list[RequestOutput]) -> Any:
    return outs.append


async def _cancelled(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancelled_after_the_engine_admitted_it_is_aborted() -> None:
    client = _client()

    async def scenario() -> None:
        outs: list[RequestOutput] = []
        task = asyncio.create_task(client.add(EngineRequest("r", PROMPT, greedy(500)), _sink(outs)))
        await asyncio.sleep(0)  # the add is on its way to the engine thread
        # Block this event loop until the engine thread has run the add (commands run in
        # order): the engine holds the request, the caller has not resumed yet. Cancel now.
        client._loop.call(lambda eng: None).result(10)
        assert "r" in _engine_state(client)[0]
        await _cancelled(task)

    asyncio.run(scenario())
    assert _engine_state(client) == ([], 0)
    client.stop()


def test_cancelled_before_the_engine_ran_it_adds_nothing() -> None:
    client = _client()
    gate = threading.Event()
    client._loop.call(lambda eng: gate.wait(10))  # the engine thread is busy

    async def scenario() -> None:
        task = asyncio.create_task(
            client.add(EngineRequest("r", PROMPT, greedy(50)), lambda o: None)
        )
        await asyncio.sleep(0)
        await _cancelled(task)
        gate.set()

    asyncio.run(scenario())
    assert _engine_state(client) == ([], 0)
    client.stop()


def test_a_cancelled_duplicate_leaves_the_request_that_owns_the_id_alone() -> None:
    client = _client()

    async def scenario() -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        await client.add(EngineRequest("r", PROMPT, greedy(40)), _sink(outs))
        dup = asyncio.create_task(
            client.add(EngineRequest("r", PROMPT, greedy(40)), lambda o: None)
        )
        await asyncio.sleep(0)
        client._loop.call(lambda eng: None).result(10)  # the duplicate was refused
        await _cancelled(dup)
        for _ in range(2000):  # the first request runs to its end, not aborted
            if outs and outs[-1].finished:
                break
            await asyncio.sleep(0.01)
        return outs

    outs = asyncio.run(scenario())
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 40
    assert _engine_state(client) == ([], 0)
    client.stop()


def test_cancelled_remote_add_frees_its_reservation() -> None:
    config = fake_config(**{"decode.local_prefill_threshold": 8})
    client = EngineClient(LLMEngine(config)).start()

    async def scenario() -> None:
        task = asyncio.create_task(
            client.add(EngineRequest("r", PROMPT, greedy(20), prefill="auto"), lambda o: None)
        )
        await asyncio.sleep(0)
        client._loop.call(lambda eng: None).result(10)
        await _cancelled(task)

    asyncio.run(scenario())
    assert _engine_state(client) == ([], 0)
    assert not client._reservations
    client.stop()


def test_a_remote_adds_reservation_comes_with_the_add_not_after_a_step() -> None:
    """The prefill call waits for these blocks: a step (under load, tens of ms) must not."""
    gate = threading.Event()
    config = fake_config(**{"decode.local_prefill_threshold": 8})
    engine = LLMEngine(config, role="decode")
    client = EngineClient(engine, before_step=lambda: gate.wait(10)).start()

    async def scenario() -> None:
        added = await client.add(
            EngineRequest("r", PROMPT, greedy(20), prefill="auto"), lambda o: None
        )
        assert added.remote and added.reservation is not None
        res = await asyncio.wait_for(added.reservation, 5)  # no step has run: the gate holds it
        assert res.request_id == "r" and len(res.block_ids) == 3  # 40 + 1 tokens
        assert engine.counters.num_steps == 0
        client.abort("r")

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
    assert _engine_state(client) == ([], 0)
    client.stop()
