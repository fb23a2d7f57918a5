"""KV streamed while prefill runs, end to end between the prefill and decode server cores in one
process (real KV transfer, the fake runner: a request that completes oracle-identical proves its
KV arrived intact). Every test ends clean on both pools: integrity, 0 used blocks, 0 leases."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.common.protocol import StreamChunk
from tests.unit.servers.test_pd_cores import Pair, _call, _collect, _oracle, _prompt

pytestmark = pytest.mark.timeout(120)

STREAM = {
    "transfer.stream_min_tokens": 48,
    "decode.local_prefill_threshold": 8,
    # ~30 ms a chunk: the decode side pulls a part while the next chunk computes.
    "testing.fake_model.prefill_delay_per_token_s": 0.002,
}


def _pair(**overrides: Any) -> Pair:
    return Pair(**{**STREAM, **overrides})


@pytest.mark.parametrize("transport", ["zmq", "shm", "loopback"])
def test_streamed_prompts_match_the_offline_engine_each_block_pulled_once(
    transport: str,
) -> None:
    prompts = {f"s{i}": _prompt(60 + 29 * i, 40 + i) for i in range(4)}  # 4 to 10 blocks each
    prompts["short"] = _prompt(20, 3)  # under the minimum: one bulk pull
    expected = _oracle(prompts, 8)
    pair = _pair(transport=transport)
    try:

        async def main() -> dict[str, list[StreamChunk]]:
            tasks = {
                rid: asyncio.create_task(_collect(pair.decode, _call(rid, p, 8)))
                for rid, p in prompts.items()
            }
            return {rid: await t for rid, t in tasks.items()}

        results = asyncio.run(main())
        for rid, chunks in results.items():
            assert [t for c in chunks for t in c.token_ids] == expected[rid], rid
        blocks = sum(-(-len(p) // 16) for p in prompts.values())
        c = pair.decode.counters
        assert c["remote_prefills"] == 5 and c["recomputed_after_failure"] == 0
        assert c["streamed_parts"] >= 4  # at least one part per streamed prompt
        assert c["pulled_blocks"] == blocks and c["reused_blocks"] == 0  # each exactly once
        assert pair.decode.receiver.stats()["blocks_received"] == blocks
        # Every lease ends acked: a decode done before the sender read its last ack lets the
        # prefill call end on that ack rather than closing it (which aborted the lease).
        pair.wait_idle_clean()
        sent = pair.prefill.sender.stats()
        assert sent["blocks_sent"] == blocks and sent["leases_acked"] == 5
    finally:
        pair.close()


def test_a_prefix_cached_on_decode_is_not_pulled_even_when_streamed() -> None:
    shared = _prompt(64, 5)  # 4 full blocks
    pair = _pair()
    try:
        asyncio.run(_collect(pair.decode, _call("warm", shared, 2)))
        before = pair.decode.counters["pulled_blocks"]
        prompt = shared + _prompt(70, 9)  # 134 tokens -> 9 blocks, 4 cached here
        expected = _oracle({"y": prompt}, 6)["y"]
        chunks = asyncio.run(_collect(pair.decode, _call("y", prompt, 6)))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert pair.decode.counters["pulled_blocks"] - before == 5
        assert pair.decode.counters["streamed_parts"] >= 1
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_a_first_token_that_ends_a_streamed_prompt_frees_everything() -> None:
    prompt = _prompt(120, 7)
    expected = _oracle({"one": prompt}, 1)["one"]
    pair = _pair()
    try:
        chunks = asyncio.run(_collect(pair.decode, _call("one", prompt, 1)))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].finish_reason == "length"
        pair.wait_idle_clean()
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_cancelling_mid_stream_frees_both_pools(transport: str) -> None:
    # ~0.2 s a chunk: cancelled after a part landed, with chunks still to compute.
    pair = _pair(transport=transport, **{"testing.fake_model.prefill_delay_per_token_s": 0.012})
    try:

        async def main() -> None:
            task = asyncio.create_task(_collect(pair.decode, _call("c", _prompt(160, 2), 50)))
            deadline = time.monotonic() + 20
            while pair.decode.receiver.stats().get("parts_ok", 0) < 1:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pair.prefill.engine.stats()["num_streaming"] <= 1

        asyncio.run(main())
        pair.wait_idle_clean()
        sent = pair.prefill.sender.stats()
        # Ended by whichever came first: the decode side's abort or the closed prefill call.
        assert sent["leases_released"] == 1
        assert sent.get("leases_peer_aborted", 0) + sent.get("leases_aborted", 0) == 1
    finally:
        pair.close()


def test_a_prefill_replica_closing_mid_stream_is_recomputed_exactly() -> None:
    """The prefill side goes away after some parts landed: the decode side waits until no
    pull writes the reserved blocks, then prefills locally (exact, seeded)."""
    prompt = _prompt(160, 4)
    expected = _oracle({"d": prompt}, 10)["d"]
    pair = _pair(**{"testing.fake_model.prefill_delay_per_token_s": 0.012})
    try:

        async def main() -> list[StreamChunk]:
            task = asyncio.create_task(_collect(pair.decode, _call("d", prompt, 10)))
            deadline = time.monotonic() + 20
            while pair.decode.receiver.stats().get("parts_ok", 0) < 1:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            await asyncio.to_thread(pair.prefill.close)  # leases end ("closed"), engine stops
            return await task

        chunks = asyncio.run(main())
        assert [t for c in chunks for t in c.token_ids] == expected
        assert pair.decode.counters["recomputed_after_failure"] == 1
        pair.decode.engine.check_integrity()
        deadline = time.monotonic() + 5
        while pair.decode.engine.stats()["kv"]["num_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pair.decode.engine.stats()["kv"]["num_used_blocks"] == 0
    finally:
        pair.decode.close()
