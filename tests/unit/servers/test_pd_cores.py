"""Prefill and decode server cores together in one process (engines apart, real KV transfer).

The fake runner's next token depends on the KV read back from the cache, so a request that
completes oracle-identical proves its KV arrived intact. Every test ends clean on both pools.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall, PrefillCall, PrefillReply, StreamChunk
from cluster.common.sampling_params import SamplingParams
from cluster.decode_worker.kv_pull import KVPull
from cluster.decode_worker.worker import DecodeWorker
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.kv_transfer import KVTransferParams
from cluster.prefill_worker.worker import PrefillWorker
from tests.helpers import fake_config, greedy, run_until_done

pytestmark = pytest.mark.timeout(120)


class InProcessPrefill:
    def __init__(self, server: PrefillWorker) -> None:
        self.server = server
        self.calls = 0

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        self.calls += 1
        return self.server.prefill(call)


def _cfg(transport: str = "zmq", **overrides: Any) -> Any:
    base = {
        "cache.num_blocks": 128,
        "transfer.transports": [transport],
        "transfer.lease_s": 2.0,
        "transfer.heartbeat_s": 0.2,
        "transfer.transfer_timeout_s": 2.0,
        "decode.local_prefill_threshold": 8,
        "prefill.graceful_shutdown_timeout_s": 5.0,
        "decode.graceful_shutdown_timeout_s": 5.0,
    }
    base.update(overrides)
    return fake_config(**base)


def _prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 37 + i * 11) % 500 for i in range(n)]


def _oracle(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    eng = LLMEngine(_cfg())
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(max_tokens)))
    return run_until_done(eng)


async def _collect(decode: DecodeWorker, call: GenerateCall) -> list[StreamChunk]:
    return [chunk async for chunk in decode.generate(call)]


def _call(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> GenerateCall:
    return GenerateCall(rid, prompt, hash_block_tokens(prompt, 16), greedy(max_tokens), **kw)


class Pair:
    def __init__(self, client: type[InProcessPrefill] = InProcessPrefill, **overrides: Any) -> None:
        cfg = _cfg(**overrides)
        self.prefill = PrefillWorker(cfg).start()
        self.client = client(self.prefill)
        self.decode = DecodeWorker(cfg, self.client).start()

    def wait_idle_clean(self, timeout: float = 5.0) -> None:
        import time

        def used_blocks() -> tuple[int, int]:
            p, d = self.prefill.engine.stats(), self.decode.engine.stats()
            return p["kv"]["num_used_blocks"], d["kv"]["num_used_blocks"]

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if used_blocks() == (0, 0) and self.prefill.sender.num_active_leases == 0:
                break
            time.sleep(0.05)
        self.prefill.engine.check_integrity()
        self.decode.engine.check_integrity()
        assert used_blocks() == (0, 0)
        assert self.prefill.sender.num_active_leases == 0

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


@pytest.mark.parametrize("transport", ["zmq", "shm", "loopback"])
def test_remote_prefill_matches_oracle(transport: str) -> None:
    prompts = {f"r{i}": _prompt(20 + 13 * i, i) for i in range(6)}
    expected = _oracle(prompts, 12)
    pair = Pair(transport=transport)
    try:

        async def main() -> dict[str, list[StreamChunk]]:
            tasks = {
                rid: asyncio.create_task(_collect(pair.decode, _call(rid, p, 12)))
                for rid, p in prompts.items()
            }
            return {rid: await t for rid, t in tasks.items()}

        results = asyncio.run(main())
        for rid, chunks in results.items():
            assert [t for c in chunks for t in c.token_ids] == expected[rid], rid
            assert chunks[-1].finish_reason == "length"
            assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "remote"
        assert pair.decode.counters["remote_prefills"] == 6
        assert pair.decode.stats()["transfer"]["transfers_ok"] == 6
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_an_ack_read_after_the_decode_finished_still_ends_the_lease_as_acked() -> None:
    """Over zmq nothing confirms the last pull's ack: a short decode can finish before the
    prefill replica reads it. The prefill call is then let end by itself (it ends on the ack)
    rather than closed at once, which made the prefill replica abort a lease about to be acked
    (counted ``aborted``, its ack then ``stale``)."""
    import threading

    prompt = _prompt(40, 3)
    expected = _oracle({"a": prompt}, 2)
    pair = Pair(transport="zmq")
    handlers = pair.prefill.sender._handlers
    real_ack, ack_read = handlers._ack, threading.Event()

    def late_ack(*args: Any) -> None:  # the sender thread reads the ack 0.1 s late
        time.sleep(0.1)
        ack_read.set()  # before it is handled: handling it lets the prefill call (and so the
        real_ack(*args)  # request) end, which may come before a set() placed after this call

    handlers._ack = late_ack
    try:
        chunks = asyncio.run(_collect(pair.decode, _call("a", prompt, 2)))
        assert [t for c in chunks for t in c.token_ids] == expected["a"]
        assert ack_read.is_set()  # the request ended only after the ack was read
        pair.wait_idle_clean()
        sent = pair.prefill.sender.stats()
        assert sent["leases_acked"] == 1 and sent.get("leases_aborted", 0) == 0
        assert sent["rejected_total"] == 0
    finally:
        pair.close()


def test_short_uncached_prompts_prefill_locally_without_transfer() -> None:
    pair = Pair()
    try:
        prompt = _prompt(6, 3)
        expected = _oracle({"x": prompt}, 5)["x"]
        chunks = asyncio.run(_collect(pair.decode, _call("x", prompt, 5)))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "local"
        assert pair.client.calls == 0
        assert pair.decode.stats()["transfer"].get("transfers_ok", 0) == 0
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_only_blocks_missing_on_decode_move() -> None:
    pair = Pair()
    try:
        shared = _prompt(64, 5)  # 4 full blocks
        asyncio.run(_collect(pair.decode, _call("warm", shared, 2)))
        before = pair.decode.counters["pulled_blocks"]
        prompt = shared + _prompt(40, 9)  # 104 tokens -> 7 blocks, 4 cached here
        expected = _oracle({"y": prompt}, 6)["y"]
        chunks = asyncio.run(_collect(pair.decode, _call("y", prompt, 6)))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert pair.decode.counters["pulled_blocks"] - before == 3
        assert pair.decode.counters["reused_blocks"] >= 4
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_cancelling_the_stream_frees_both_pools() -> None:
    pair = Pair(**{"testing.fake_model.decode_delay_s": 0.02})
    try:

        async def main() -> None:
            gen = pair.decode.generate(_call("c", _prompt(50, 2), 200))
            async for _chunk in gen:
                break  # the first token arrived: cancel mid-stream
            await gen.aclose()

        asyncio.run(main())
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_closing_the_stream_ends_the_request_before_aclose_returns() -> None:
    """Ray Serve closes (or throws into) the outermost generator only: every generator nested
    in it must be closed with it, not left to the garbage collector (a collection can be
    minutes away in a big process: the request's reserved blocks waited for it)."""
    pair = Pair(**{"testing.fake_model.decode_delay_s": 0.02})
    try:

        async def main() -> None:
            gen = pair.decode.generate(_call("c", _prompt(50, 2), 200))
            first = await gen.__anext__()
            assert first.token_ids and pair.decode.stats()["handoff_stages"] in (
                {"first_token": 1},  # the first token from the reply: pull, kv_arrived to come
                {"decode": 1},
            )
            gc.disable()  # nothing may depend on a collection
            try:
                await gen.aclose()
                assert pair.decode.stats()["handoff_stages"] == {}  # ended inside aclose
            finally:
                gc.enable()

        asyncio.run(main())
        pair.wait_idle_clean()
    finally:
        pair.close()


@pytest.mark.parametrize(
    ("prompt_len", "n", "max_tokens"),
    [
        (60, 1, 6),
        (64, 3, 6),  # a full last block: the reply carries every sample's first token
        (60, 3, 6),  # a partial one: the samples draw theirs here
        (60, 1, 1),  # the first token ends the request: nothing to pull, still two entries
        (64, 3, 1),
        (60, 3, 1),  # sample 0's ends it there; the samples prefill here without its KV
    ],
)
def test_a_remote_request_enters_the_decode_engine_thread_exactly_twice(
    prompt_len: int, n: int, max_tokens: int
) -> None:
    """``add``, then ``kv_arrived`` with the reply's first tokens: the reservation and the
    outputs come by callback, the first tokens from the reply. The stream equals one engine's
    (every sample: tokens, text, logprobs)."""
    prompt = _prompt(prompt_len, 4)
    params = _sampled(max_tokens)
    eng = LLMEngine(_cfg())
    eng.add(EngineRequest("e", prompt, params, seed=5, n=n))
    expected: dict[int, list[Any]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            expected.setdefault(out.index, []).append(out)
    pair = Pair()
    entries: list[str] = []
    loop = pair.decode.engine._loop
    real_call = loop.call

    def counting_call(fn: Any) -> Any:
        entries.append(fn.__qualname__)
        return real_call(fn)

    loop.call = counting_call  # type: ignore[method-assign]
    try:
        call = GenerateCall("e", prompt, hash_block_tokens(prompt, 16), params, n=n)
        chunks = asyncio.run(_collect(pair.decode, call))
        loop.call = real_call  # type: ignore[method-assign]
        assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "remote"
        assert entries == ["EngineLoop.add.<locals>.add", "EngineLoop.call_ending.<locals>.ending"]
        for index, want in expected.items():
            got = [c for c in chunks if c.index == index]
            assert [t for c in got for t in c.token_ids] == [
                t for o in want for t in o.new_token_ids
            ], index
            assert "".join(c.text for c in got) == "".join(o.new_text for o in want), index
            assert [x for c in got for x in c.logprobs or []] == [
                x for o in want for x in o.new_logprobs or []
            ], index
            assert [c.finish_reason for c in got if c.finish_reason] == [want[-1].finish_reason]
        assert sorted({c.index for c in chunks}) == list(range(n))
        pair.wait_idle_clean()
    finally:
        loop.call = real_call  # type: ignore[method-assign]
        pair.close()


def _sampled(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=max_tokens, logprobs=1, seed=5)


class LateFor(InProcessPrefill):
    """A prefill client whose call for one request reaches the prefill replica late (a slow
    network path, a busy router): calls for other requests overtake it."""

    def __init__(self, server: PrefillWorker, late_rid: str, delay_s: float) -> None:
        super().__init__(server)
        self.late_rid, self.delay_s = late_rid, delay_s

    async def _late(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        if call.request_id == self.late_rid:
            await asyncio.sleep(self.delay_s)
        async for item in self.server.prefill(call):
            yield item

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        self.calls += 1
        return self._late(call)


def test_two_full_pools_cannot_deadlock() -> None:
    """Pools of 5 blocks each; a 64-token prompt A joins the decode replica just before a 32-token
    prompt B, but A's prefill call reaches the prefill replica late. Were the prefill called
    while the decode side waits for blocks, it would deadlock: the decode blocks go to A (the
    oldest), the prefill replica prefills B first and holds its 2 blocks for a pull that has no
    blocks to land in, and A's 4 blocks no longer fit beside them there. The decode replica
    reserves first, so the prefill pool only holds KV with somewhere to go: both finish,
    exactly, and both pools end clean."""
    prompts = {"a": _prompt(64, 7), "b": _prompt(32, 8)}
    expected = _oracle(prompts, 8)
    pair = Pair(
        **{
            "cache.num_blocks": 5,
            "scheduler.max_num_batched_tokens": 64,
            "scheduler.chunk_size": 16,
            "transfer.lease_s": 30.0,  # a lease never expires here: liveness may not rest on it
            "prefill.graceful_shutdown_timeout_s": 35.0,
            "decode.graceful_shutdown_timeout_s": 35.0,
        }
    )
    pair.decode._ctx.prefill_client = LateFor(pair.prefill, "a", 0.5)
    try:

        async def main() -> dict[str, list[int]]:
            async def one(rid: str) -> list[int]:
                chunks = await _collect(pair.decode, _call(rid, prompts[rid], 8))
                return [t for c in chunks for t in c.token_ids]

            a = asyncio.create_task(one("a"))
            await asyncio.sleep(0)  # A joins the decode engine first
            b = asyncio.create_task(one("b"))
            got = await asyncio.wait_for(asyncio.gather(a, b), timeout=30)
            return dict(zip(("a", "b"), got))

        assert asyncio.run(main()) == expected
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_prompts_that_fill_their_last_block_cannot_stall_a_full_decode_pool() -> None:
    """12 remote prompts of exactly 5 blocks (4 groups sharing 4-block prefixes) into pools of 20
    blocks. A reservation of the prompt's blocks alone left each arrived request one block short
    of its first decode step; with every block reserved none could run, so none could be
    preempted, and the pool stalled. A reservation holds room for the first token's KV too."""
    rng = random.Random(8)
    prefixes = [[rng.randrange(1, 500) for _ in range(64)] for _ in range(4)]
    prompts = {
        f"g{g}-{i}": prefixes[g] + [rng.randrange(1, 500) for _ in range(16)]
        for g in range(4)
        for i in range(3)
    }
    expected = _oracle(prompts, 8)
    pair = Pair(
        **{
            "cache.num_blocks": 20,
            "decode.local_prefill_threshold": 0,
            "scheduler.max_num_batched_tokens": 256,
            "scheduler.chunk_size": 64,
        }
    )
    try:

        async def main() -> dict[str, list[int]]:
            calls = [_call(rid, p, 8) for rid, p in prompts.items()]
            outs = await asyncio.wait_for(
                asyncio.gather(*(_collect(pair.decode, c) for c in calls)), timeout=60
            )
            return {
                c.request_id: [t for ch in o for t in ch.token_ids] for c, o in zip(calls, outs)
            }

        assert asyncio.run(main()) == expected
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_the_first_token_reaches_the_client_before_the_pull_and_the_decode_engine() -> None:
    """The prefill reply carries the first token's text: the client has it while the KV has
    not moved and the decode engine has not taken it (both held here until then), and every
    chunk after it, text held back for a stop string and logprobs too, is what one engine
    alone streams."""
    never = " t9999 never"  # holds back the last 11 characters of each text delta
    params = {
        "a": greedy(10, logprobs=2),
        "b": greedy(10, stop=(never,), logprobs=1),
        "c": greedy(10, stop=(never,), include_stop_str_in_output=True),
    }
    prompts = {"a": _prompt(40, 1), "b": _prompt(57, 2), "c": _prompt(33, 3)}
    eng = LLMEngine(_cfg())
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, params[rid]))
    expected: dict[str, list[Any]] = {rid: [] for rid in prompts}
    while eng.has_unfinished_requests():
        for out in eng.step():
            expected[out.request_id].append(out)
    pair = Pair()
    real_kv_arrived = pair.decode.engine.kv_arrived
    real_finish = KVPull.finish
    try:

        async def one(rid: str, released: asyncio.Event) -> list[StreamChunk]:
            call = GenerateCall(rid, prompts[rid], hash_block_tokens(prompts[rid], 16), params[rid])
            stream = aiter(pair.decode.generate(call))
            first = await asyncio.wait_for(anext(stream), 10)  # pull and engine entry held
            while not (first.token_ids or first.text):
                first = await asyncio.wait_for(anext(stream), 10)
            released.set()
            return [first, *[chunk async for chunk in stream]]

        async def main() -> dict[str, list[StreamChunk]]:
            released = {rid: asyncio.Event() for rid in prompts}

            async def held_kv_arrived(rid: str, first_tokens: Any) -> None:
                assert released[rid].is_set()  # (the pull waited for it already)
                await real_kv_arrived(rid, first_tokens)

            async def held_finish(pull: KVPull, params: KVTransferParams) -> int:
                await released[params.request_id.split("#")[0]].wait()
                return await real_finish(pull, params)

            pair.decode.engine.kv_arrived = held_kv_arrived  # type: ignore[method-assign]
            KVPull.finish = held_finish  # type: ignore[method-assign]
            return dict(
                zip(
                    prompts,
                    await asyncio.gather(*(one(rid, released[rid]) for rid in prompts)),
                    strict=True,
                )
            )

        results = asyncio.run(main())
        for rid, chunks in results.items():
            want = expected[rid]
            assert chunks[0].token_ids == want[0].new_token_ids, rid
            assert chunks[0].text == want[0].new_text, rid
            assert [t for c in chunks for t in c.token_ids] == [
                t for o in want for t in o.new_token_ids
            ], rid
            assert "".join(c.text for c in chunks) == "".join(o.new_text for o in want), rid
            lps = [x for c in chunks for x in c.logprobs or []]
            assert lps == [x for o in want for x in o.new_logprobs or []], rid
            tops = [x for c in chunks for x in c.top_logprobs or []]
            assert tops == [x for o in want for x in o.new_top_logprobs or []], rid
            assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "remote"
        pair.wait_idle_clean()
    finally:
        KVPull.finish = real_finish  # type: ignore[method-assign]
        pair.decode.engine.kv_arrived = real_kv_arrived  # type: ignore[method-assign]
        pair.close()


def test_a_first_token_that_ends_the_request_ends_it_without_a_pull() -> None:
    """EOS, a stop string, ``max_tokens`` 1: the reply's token is the last chunk (finish
    reason, usage); no KV moves, the prefill side frees its blocks, and the decode engine ends
    the request at its second entry, with no output of its own."""
    stop = " t"  # every text delta of the fake tokenizer starts with it: the first one stops
    cases = {
        "len": greedy(1, logprobs=1),
        "stop": SamplingParams(temperature=0.0, max_tokens=8, stop=(stop,)),
    }
    prompts = {"len": _prompt(40, 1), "stop": _prompt(50, 2)}
    pair = Pair()
    try:
        for rid, params in cases.items():
            eng = LLMEngine(_cfg())
            eng.add(EngineRequest(rid, prompts[rid], params))
            (want,) = [o for o in run_until_done_outputs(eng) if o.new_token_ids or o.finished]
            call = GenerateCall(rid, prompts[rid], hash_block_tokens(prompts[rid], 16), params)
            chunks = asyncio.run(_collect(pair.decode, call))
            assert [(c.token_ids, c.text, c.finish_reason) for c in chunks] == [
                (want.new_token_ids, want.new_text, want.finish_reason)
            ], rid
            assert chunks[0].logprobs == want.new_logprobs, rid
            usage = chunks[0].usage
            assert usage is not None and usage.prefill_mode == "remote", rid
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[rid]), 1)
        assert pair.decode.stats()["transfer"].get("transfers_ok", 0) == 0
        assert pair.decode.stats()["engine"]["num_aborted"] == 0  # ended, not aborted
        pair.wait_idle_clean()
    finally:
        pair.close()


def run_until_done_outputs(eng: LLMEngine) -> list[Any]:
    outs: list[Any] = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    return outs


def test_a_decode_engine_that_dies_after_the_first_token_ends_the_stream_unavailable() -> None:
    """The client has the first token already: the router must see UNAVAILABLE (it reports
    ABORTED), not an unnamed internal error; nothing stays behind on the prefill side."""
    from cluster.common.errors import ErrorCode, PDServeError
    from cluster.engine.step_loop import EngineDeadError

    pair = Pair()
    real_kv_arrived = pair.decode.engine.kv_arrived

    async def dead(*args: Any) -> Any:
        raise EngineDeadError("engine step failed: boom")

    pair.decode.engine.kv_arrived = dead  # type: ignore[method-assign]
    try:
        chunks: list[StreamChunk] = []

        async def main() -> None:
            async for chunk in pair.decode.generate(_call("d", _prompt(40, 9), 6)):
                chunks.append(chunk)

        with pytest.raises(PDServeError) as err:
            asyncio.run(main())
        assert err.value.code == ErrorCode.UNAVAILABLE
        assert [t for c in chunks for t in c.token_ids] != []  # the first token went out
        pair.decode.engine.kv_arrived = real_kv_arrived  # type: ignore[method-assign]
        pair.wait_idle_clean()
    finally:
        pair.decode.engine.kv_arrived = real_kv_arrived  # type: ignore[method-assign]
        pair.close()


class SlowClose(InProcessPrefill):
    """A prefill call that takes a moment to close (a slow network path)."""

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        inner = self.server.prefill(call)

        async def stream() -> AsyncIterator[Any]:
            try:
                async for item in inner:
                    yield item
            finally:
                await asyncio.sleep(0.3)
                await inner.aclose()  # type: ignore[attr-defined]

        return stream()


def test_a_second_cancellation_during_the_streams_cleanup_still_frees_the_request() -> None:
    """A client gone twice (the stream cancelled after the first token, before the KV came, then
    again while it closes the prefill call): the decode engine's abort still runs. Skipped, the
    request waits for KV forever and its reserved blocks stay held."""
    pair = Pair(SlowClose, **{"testing.fake_model.decode_delay_s": 0.005})
    real_kv_arrived = pair.decode.engine.kv_arrived

    async def never(*args: Any) -> Any:
        await asyncio.Event().wait()  # the engine's turn for the first token never comes

    pair.decode.engine.kv_arrived = never  # type: ignore[method-assign]
    try:

        async def main() -> None:
            first = asyncio.Event()

            async def consume() -> None:
                async for chunk in pair.decode.generate(_call("c", _prompt(60, 5), 400)):
                    if chunk.token_ids and len(chunk.token_ids) and not first.is_set():
                        first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 10)  # the first token, from the reply
            task.cancel()
            await asyncio.sleep(0.1)  # the stream is closing the prefill call (0.3 s)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(1.0)  # the cleanup, in a task of its own, ends

        asyncio.run(main())
        pair.wait_idle_clean()
    finally:
        pair.decode.engine.kv_arrived = real_kv_arrived  # type: ignore[method-assign]
        pair.close()


class CancelledWithItsParent(InProcessPrefill):
    """Ray Serve cancels a request's calls to other deployments along with it (its replica
    cancels them itself): reading such a call then raises ``asyncio.CancelledError`` in a task
    nobody cancelled. Here that happens once ``parent_gone`` is set, after the reply."""

    def __init__(self, server: PrefillWorker) -> None:
        super().__init__(server)
        self.parent_gone = asyncio.Event()

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        inner = self.server.prefill(call)

        async def stream() -> AsyncIterator[Any]:
            try:
                async for item in inner:
                    yield item
                    if isinstance(item, PrefillReply):
                        await self.parent_gone.wait()
                        raise asyncio.CancelledError
            finally:
                await inner.aclose()  # type: ignore[attr-defined]

        return stream()


def test_a_prefill_call_cancelled_with_its_parent_cannot_keep_the_request_in_the_engine() -> None:
    """The client goes while the KV's arrival waits for the decode engine's turn (so the engine
    never hears of it), and the prefill call, cancelled by Serve with its parent, raises
    CancelledError as the stream closes it: the engine's abort still runs. Skipped (CI's F9
    abort storm, 1 run in 3), the request waited for KV forever with its blocks reserved."""
    pair = Pair(CancelledWithItsParent, **{"testing.fake_model.decode_delay_s": 0.005})
    client = pair.client
    assert isinstance(client, CancelledWithItsParent)
    engine = pair.decode.engine
    real_kv_arrived = engine.kv_arrived
    gate = threading.Event()  # the decode engine busy with a step until set
    try:

        async def main() -> None:
            queued = asyncio.Event()

            async def kv_arrived_behind_a_step(rid: str, first_tokens: Any) -> None:
                engine._loop.call(lambda eng: gate.wait(10))
                queued.set()
                await real_kv_arrived(rid, first_tokens)

            engine.kv_arrived = kv_arrived_behind_a_step  # type: ignore[method-assign]

            async def consume() -> None:
                async for _chunk in pair.decode.generate(_call("c", _prompt(60, 5), 400)):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.wait_for(queued.wait(), 10)  # the KV is here, the engine not told
            client.parent_gone.set()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await asyncio.sleep(0.5)  # the cleanup, in a task of its own, ends

        asyncio.run(main())
        pair.wait_idle_clean()
    finally:
        gate.set()
        engine.kv_arrived = real_kv_arrived  # type: ignore[method-assign]
        pair.close()
