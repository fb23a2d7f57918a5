"""KV streamed while prefill runs, with the pool workers as real processes (fake model): a pool
dying mid-stream, after parts of a prompt's KV already moved. The request ends oracle-identical
(recompute) and every surviving pool is idle-clean (0 used blocks, 0 leases, integrity ok)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from cluster.common.errors import PDServeError
from tests.faults.test_pd_process_faults import (
    assert_idle_clean,
    cfg,
    gen_call,
    oracle,
    prompt,
    tokens_of,
)
from tests.harness.launcher import Worker, start_worker, stop_workers
from tests.harness.rpc import RpcClient

pytestmark = pytest.mark.timeout(180)

STREAM = {
    "transfer.stream_min_tokens": 64,
    "scheduler.chunk_size": 32,
    "scheduler.max_num_batched_tokens": 64,
    # ~0.3 s a chunk: plenty of parts land before the last chunk.
    "testing.fake_model.prefill_delay_per_token_s": 0.01,
}


async def _wait_for_a_part(client: RpcClient, task: asyncio.Task[list[int]]) -> None:
    deadline = time.monotonic() + 30
    while (await client.call("stats"))["transfer"].get("parts_ok", 0) < 1:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)


def test_prefill_dies_mid_stream_and_the_request_is_recomputed_exactly(tmp_path: Path) -> None:
    p = prompt(320, 5)  # 10 chunks of 32 tokens
    expected = oracle({"a": p}, 10)["a"]
    c = cfg(**STREAM)
    pw = start_worker("prefill", c, tmp_path)
    dw = start_worker("decode", c, tmp_path, prefill=[pw.endpoint])
    try:

        async def main() -> None:
            client = RpcClient(dw.endpoint)
            task = asyncio.create_task(tokens_of(client, gen_call("a", p, 10)))
            await _wait_for_a_part(client, task)
            pw.kill()  # SIGKILL, holding a growing lease with chunks still to compute
            pw.popen.wait(10)
            assert await task == expected
            stats = await client.call("stats")
            assert stats["recomputed_after_failure"] == 1
            client.close()
            await assert_idle_clean(dw)

        asyncio.run(main())
    finally:
        stop_workers([dw, pw])


def test_decode_dies_mid_stream_and_the_growing_lease_expires(tmp_path: Path) -> None:
    c = cfg(**STREAM)
    pw = start_worker("prefill", c, tmp_path)
    dw: Worker = start_worker("decode", c, tmp_path, prefill=[pw.endpoint])
    try:

        async def main() -> None:
            client = RpcClient(dw.endpoint)
            task = asyncio.create_task(tokens_of(client, gen_call("b", prompt(320, 6), 10)))
            await _wait_for_a_part(client, task)
            dw.kill()
            dw.popen.wait(10)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, PDServeError):
                await task  # the client's call died with the decode worker
            client.close()
            assert pw.alive(), pw.log.read_text()[-3000:]
            # No more heartbeats: the lease expires (1 s), the prefill still running is ended.
            await assert_idle_clean(pw, timeout=15.0)
            pclient = RpcClient(pw.endpoint)
            stats = await pclient.call("stats")
            pclient.close()
            assert stats["transfer"]["leases_expired"] == 1
            assert stats["engine"]["num_streaming"] == 0

        asyncio.run(main())
    finally:
        stop_workers([dw, pw])
