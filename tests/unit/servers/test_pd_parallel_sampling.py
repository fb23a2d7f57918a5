"""n > 1 through the decode replica's hand-off (Ray-free cores): one prefill call and one KV
transfer serve all n samples; chunks carry their sample's index; the usage counts the prompt
once, at the very end; cancelling mid-stream frees every sample in both pools."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall, StreamChunk
from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.parallel import sample_ids
from tests.helpers import run_until_done
from tests.unit.servers.test_pd_cores import Pair, _cfg, _collect, _prompt

pytestmark = pytest.mark.timeout(120)

PARAMS = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)


def _oracle(prompt: list[int], n: int) -> list[list[int]]:
    eng = LLMEngine(_cfg())
    eng.add(EngineRequest("x", prompt, PARAMS, n=n))
    out = run_until_done(eng)
    return [out[rid] for rid in sample_ids("x", n)]


def _by_index(chunks: list[StreamChunk], n: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    for c in chunks:
        tokens[c.index].extend(c.token_ids)
    return tokens


def _count_decode_steps(pair: Pair) -> dict[str, int]:
    """Wraps the decode engine's runner: prompt tokens it computes, its peak blocks in use."""
    eng = pair.decode.engine._engine
    execute = eng.runner.execute
    seen = {"prompt_tokens": 0, "peak_blocks": 0}

    def counting(batch: Any) -> Any:
        for it in batch.items:
            r = it.request
            seen["prompt_tokens"] += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        seen["peak_blocks"] = max(seen["peak_blocks"], eng.block_manager.num_used_blocks)
        return execute(batch)

    eng.runner.execute = counting
    return seen


# local prefill (short); remote, the last block partial; remote, the last block full
@pytest.mark.parametrize("prompt_len", [6, 45, 48])
def test_n_samples_one_prefill_one_transfer(prompt_len: int) -> None:
    prompt = _prompt(prompt_len, 4)
    expected = _oracle(prompt, 4)
    pair = Pair()
    decode_steps = _count_decode_steps(pair)
    try:
        call = GenerateCall("x", prompt, hash_block_tokens(prompt, 16), PARAMS, n=4)
        chunks = asyncio.run(_collect(pair.decode, call))
        assert _by_index(chunks, 4) == expected
        assert len({tuple(t) for t in expected}) > 1  # four seed streams
        finishes = [(c.index, c.finish_reason) for c in chunks if c.finish_reason]
        assert sorted(finishes) == [(i, "length") for i in range(4)]
        assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == prompt_len
        assert usage.completion_tokens == 4 * 12
        remote = prompt_len > 8
        assert usage.prefill_mode == ("remote" if remote else "local")
        assert pair.client.calls == int(remote)  # one prefill for all four
        assert pair.decode.stats()["transfer"].get("transfers_ok", 0) == int(remote)
        if remote and prompt_len % 16 == 0:
            # The prefill replica drew all four first tokens: nothing of the prompt is computed
            # here, and the samples share all 3 prompt blocks (+ one own block each).
            assert decode_steps["prompt_tokens"] == 0
            assert decode_steps["peak_blocks"] == 3 + 4
        elif remote:  # each extra sample recomputes the 13-token tail into a block of its own
            assert decode_steps["prompt_tokens"] == 3 * (prompt_len % 16)
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_n8_on_a_512_token_prompt_holds_the_block_bound_through_pd() -> None:
    prompt = _prompt(512, 3)
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=9)
    pair = Pair(**{"model.max_model_len": 1024})
    decode_steps = _count_decode_steps(pair)
    try:
        call = GenerateCall("b", prompt, hash_block_tokens(prompt, 16), params, n=8)
        chunks = asyncio.run(_collect(pair.decode, call))
        assert [len(t) for t in _by_index(chunks, 8)] == [16] * 8
        one_prompt_plus_8_outputs = 512 // 16 + 8 * 1
        assert decode_steps["peak_blocks"] <= 1.15 * one_prompt_plus_8_outputs, decode_steps
        assert decode_steps["peak_blocks"] == one_prompt_plus_8_outputs  # copy-on-write's count
        assert decode_steps["prompt_tokens"] == 0
        assert pair.client.calls == 1
        pair.wait_idle_clean()
    finally:
        pair.close()


def test_cancelling_mid_stream_frees_every_sample() -> None:
    pair = Pair(**{"testing.fake_model.decode_delay_s": 0.02})
    try:
        prompt = _prompt(50, 2)
        params = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True)

        async def main() -> set[int]:
            call = GenerateCall("c", prompt, hash_block_tokens(prompt, 16), params, n=6)
            gen = pair.decode.generate(call)
            seen: set[int] = set()
            async for chunk in gen:
                seen.add(chunk.index)
                if len(seen) == 6:
                    break  # every sample is decoding: cancel mid-stream
            await gen.aclose()
            return seen

        assert asyncio.run(main()) == set(range(6))
        pair.wait_idle_clean()
        assert not pair.decode.engine.stats()["num_samples_waiting"]
    finally:
        pair.close()
