"""Speculative decoding through the prefill/decode hand-off (server cores in one process).

The decode pool owns speculation: after a KV import (remote prefill) and after a local prefill,
a request's drafts are verified in the decode engine and its output equals the oracle's (the
same fake model without speculation); usage reports drafted and accepted tokens. Cancelling a
stream while a verification is in flight leaves nothing behind in either pool.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cluster.engine.batch import ScheduledBatch
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.spec_helpers import ScriptedProposer, use_proposer
from tests.unit.servers.test_pd_cores import Pair, _call, _collect, _oracle, _prompt

pytestmark = pytest.mark.timeout(120)

# A fixed draft row cost: measured (the default), it comes from this box's noisy step timings,
# and each request here must draft and have drafts accepted.
SPEC = {
    "decode.speculative.method": "ngram",
    "decode.speculative.num_speculative_tokens": 4,
    "decode.speculative.measure_row_cost": False,
}


def _decode_engine(pair: Pair) -> LLMEngine:
    return pair.decode.engine._engine


def test_remote_and_local_requests_speculate_after_the_hand_off() -> None:
    # Prompts over the threshold (8) are prefilled remotely, the two short ones locally.
    prompts = {f"r{i}": _prompt(5 + 11 * i, i) for i in range(6)}
    expected = _oracle(prompts, 24)
    pair = Pair(**SPEC)
    use_proposer(_decode_engine(pair), ScriptedProposer(expected, 512, wrong_share=0.25))
    try:

        async def main() -> dict[str, Any]:
            tasks = {
                rid: asyncio.create_task(_collect(pair.decode, _call(rid, p, 24)))
                for rid, p in prompts.items()
            }
            return {rid: await t for rid, t in tasks.items()}

        results = asyncio.run(main())
        modes = set()
        for rid, chunks in results.items():
            assert [t for c in chunks for t in c.token_ids] == expected[rid], rid
            usage = chunks[-1].usage
            assert usage is not None and usage.completion_tokens == 24
            assert usage.draft_tokens >= usage.accepted_draft_tokens > 0, rid
            assert len(chunks) < 24  # several tokens per chunk where drafts were accepted
            modes.add(usage.prefill_mode)
        assert modes == {"local", "remote"}
        pair.wait_idle_clean()
        # Engine stats are a snapshot of the last step loop iteration: idle by now.
        spec = pair.decode.stats()["engine"]["spec"]
        assert spec["num_accepted_tokens"] == sum(
            c[-1].usage.accepted_draft_tokens for c in results.values()
        )
        assert pair.prefill.engine.stats()["spec"]["num_draft_tokens"] == 0  # decode pool only
    finally:
        pair.close()


def test_prompt_lookup_drafts_from_an_imported_prompt() -> None:
    # A small vocabulary makes the fake model's output quote its prompt now and then; the
    # decode side never computed these prompts (their KV was pulled), it reads their tokens.
    small = {"testing.fake_model.vocab_size": 16, "decode.local_prefill_threshold": 0}
    prompts = {f"q{i}": [1 + (i + j * 5) % 15 for j in range(40)] for i in range(3)}
    expected = {
        rid: toks
        for rid, toks in _oracle_with(prompts, 40, small).items()  # same fake model, no drafts
    }
    pair = Pair(**SPEC, **small)
    try:

        async def main() -> dict[str, Any]:
            return {
                rid: await _collect(pair.decode, _call(rid, p, 40)) for rid, p in prompts.items()
            }

        results = asyncio.run(main())
        for rid, chunks in results.items():
            assert [t for c in chunks for t in c.token_ids] == expected[rid], rid
            assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "remote"
        assert pair.decode.stats()["engine"]["spec"]["num_draft_tokens"] > 0
        pair.wait_idle_clean()
    finally:
        pair.close()


def _oracle_with(prompts: dict[str, list[int]], max_tokens: int, overrides: dict[str, Any]) -> Any:
    from tests.helpers import greedy, run_until_done
    from tests.unit.servers.test_pd_cores import _cfg

    eng = LLMEngine(_cfg(**overrides))
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(max_tokens)))
    return run_until_done(eng)


def test_cancelling_mid_verification_frees_both_pools() -> None:
    prompt = _prompt(50, 2)
    expected = _oracle({"c": prompt}, 60)
    pair = Pair(**SPEC)
    engine = _decode_engine(pair)
    use_proposer(engine, ScriptedProposer(expected, 512))
    runner = engine.runner
    real_execute = runner.execute
    verifying = threading.Event()
    release = threading.Event()

    def execute(batch: ScheduledBatch) -> Any:
        if any(it.draft_token_ids for it in batch.items) and not verifying.is_set():
            verifying.set()  # drafts are in the forward now: the stream is cancelled meanwhile
            release.wait(10)
        return real_execute(batch)

    runner.execute = execute  # type: ignore[method-assign]
    try:

        async def main() -> None:
            task = asyncio.create_task(_collect(pair.decode, _call("c", prompt, 60)))
            assert await asyncio.to_thread(verifying.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            await asyncio.sleep(0.2)

        asyncio.run(main())
        pair.wait_idle_clean()
        assert engine.stats()["num_aborted"] == 1
    finally:
        release.set()
        pair.close()
