"""``PoolReplica.record_routing_stats`` while the engine is inside a long step.

Serve's controller asks every replica for its routing stats; a replica whose engine thread is in
a prefill of several seconds used to time out, and the controller logged an ERROR with a
traceback for a replica that was only busy. Now it answers with the engine's last block hashes
and current load, keeps one question in flight, and fails only when the engine is dead.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.common.faults import FaultPoints
from cluster.serving import replica as replica_mod
from cluster.serving.replica import PoolReplica
from tests.helpers import fake_config


class Engine:
    def __init__(self) -> None:
        self.asked = 0
        self.answer: asyncio.Future[list[int]] | None = None
        self.running = 0

    async def cached_block_hashes(self) -> list[int]:
        self.asked += 1
        self.answer = asyncio.get_running_loop().create_future()
        return await self.answer

    def stats(self) -> dict[str, Any]:
        return {"kv": {"usage": 0.25}, "num_running": self.running, "num_waiting": 0}

    def check_integrity(self, timeout_s: float = 30.0) -> None:
        pass


class Worker:
    def __init__(self) -> None:
        self.engine = Engine()
        self.faults = FaultPoints()
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def stats(self) -> dict[str, Any]:
        return {"engine": self.engine.stats()}

    def close(self) -> None:
        pass


class Replica(PoolReplica):
    role = "decode"


@pytest.fixture
def replica(monkeypatch: pytest.MonkeyPatch) -> Replica:
    monkeypatch.setattr(replica_mod, "freeze_startup_heap", lambda _what: 0)  # not pytest's heap
    config = fake_config(**{"decode.routing.stats_period_s": 0.05})  # waits 1 s at most
    return Replica(config, "r1", Worker())


def test_a_busy_engine_gets_its_last_answer_not_an_error(replica: Replica) -> None:
    engine: Engine = replica.worker.engine  # type: ignore[assignment]

    async def scenario() -> None:
        first = asyncio.ensure_future(replica.record_routing_stats())
        await asyncio.sleep(0.01)
        assert engine.answer is not None
        engine.answer.set_result([11, 22])  # between two steps: answered at once
        snap = await first
        assert snap == replica_mod.snapshot_from_stats([11, 22], engine.stats())

        # A long step: the engine does not answer within the wait; the load is current.
        engine.running = 7
        snap = await asyncio.wait_for(replica.record_routing_stats(), 5)
        assert snap == replica_mod.snapshot_from_stats([11, 22], engine.stats())
        assert engine.asked == 2
        # Asked again while the question is still open: answered at once, not asked twice.
        t0 = asyncio.get_running_loop().time()
        snap = await asyncio.wait_for(replica.record_routing_stats(), 5)
        assert asyncio.get_running_loop().time() - t0 < 0.5  # not another 1 s wait
        assert snap == replica_mod.snapshot_from_stats([11, 22], engine.stats())
        assert engine.asked == 2
        # The step ends: the open question's answer is used.
        assert engine.answer is not None
        engine.answer.set_result([33])
        snap = await asyncio.wait_for(replica.record_routing_stats(), 5)
        assert snap == replica_mod.snapshot_from_stats([33], engine.stats())
        assert engine.asked == 2

        # A dead engine fails the call (Serve records it; its health check replaces it).
        replica.worker.alive = False  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="dead"):
            await replica.record_routing_stats()

    asyncio.run(scenario())
