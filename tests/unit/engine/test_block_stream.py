"""KV streaming in the prefill role (``transfer.stream_min_tokens``): each finished chunk's full
blocks are pinned and announced while the later chunks compute, the first token hands over the
announced blocks plus the tail, and only the lease's release frees what was announced.

Fake runner (its next token depends on the KV read back), 16-token blocks and chunks. Every test
ends with the integrity check and an idle-clean pool.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput
from tests.helpers import fake_config, greedy, run_until_done

STREAM = {"transfer.stream_min_tokens": 32}


def _engine(role: str = "prefill", **overrides: object) -> LLMEngine:
    return LLMEngine(fake_config(**{**STREAM, **overrides}), role=role)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 7 + i * 13) % 500 for i in range(n)]


def _steps(eng: LLMEngine) -> list[list[RequestOutput]]:
    out = []
    while eng.has_unfinished_requests():
        out.append(eng.step())
    return out


def _assert_idle_clean(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.requests
    assert eng.stats()["num_held"] == 0 and eng.stats()["num_streaming"] == 0


def _bulk_prefill(prompt: list[int]) -> tuple[int, torch.Tensor]:
    """The same prompt prefilled without streaming: its first token and its blocks' KV."""
    eng = _engine(**{"transfer.stream_min_tokens": 0})
    eng.add(EngineRequest("ref", prompt, greedy(4), seed=3))
    (first,) = [o for step in _steps(eng) for o in step]
    assert first.held_block_ids is not None
    kv = eng.runner.kv_cache[first.held_block_ids].clone()
    assert eng.release("ref")
    return first.new_token_ids[0], kv


def test_each_chunk_announces_its_blocks_and_the_first_token_adds_the_tail() -> None:
    p = _prompt(100)  # 6 full blocks + 4 tokens; chunks of 16: 7 steps
    token, ref_kv = _bulk_prefill(p)
    eng = _engine()
    eng.add(EngineRequest("s", p, greedy(4), seed=3))
    steps = _steps(eng)
    progress = [o for step in steps for o in step if o.streamed_block_ids is not None]
    (first,) = [o for step in steps for o in step if o.new_token_ids]
    assert [len(o.streamed_block_ids or []) for o in progress] == [1, 2, 3, 4, 5, 6]
    lists = [o.streamed_block_ids or [] for o in progress]
    for a, b in itertools.pairwise(lists):
        assert b[: len(a)] == a  # each announcement extends the last
    assert all(not o.finished and not o.new_token_ids for o in progress)
    held = first.held_block_ids
    assert held is not None and len(held) == 7
    assert held[:6] == progress[-1].streamed_block_ids  # the tail is the last chunk's block
    assert first.new_token_ids == [token]
    assert torch.equal(eng.runner.kv_cache[held], ref_kv)
    assert eng.block_manager.num_used_blocks == 7  # pins share the blocks, nothing doubled
    assert eng.stats()["num_streaming"] == 1
    eng.check_integrity()
    assert eng.release("s")
    assert not eng.release("s")
    _assert_idle_clean(eng)


def test_short_prompts_and_a_zero_minimum_never_stream() -> None:
    for eng, n in ((_engine(), 31), (_engine(**{"transfer.stream_min_tokens": 0}), 100)):
        eng.add(EngineRequest("x", _prompt(n), greedy(3)))
        outs = [o for step in _steps(eng) for o in step]
        assert all(o.streamed_block_ids is None for o in outs)
        assert eng.release("x")
        _assert_idle_clean(eng)


@pytest.mark.parametrize("caching", [True, False])
def test_a_preempted_streamed_prompt_keeps_what_it_announced(caching: bool) -> None:
    p = _prompt(100, seed=2)
    token, ref_kv = _bulk_prefill(p)
    eng = _engine(**{"cache.enable_prefix_caching": caching})
    eng.add(EngineRequest("s", p, greedy(4), seed=3))
    steps = [eng.step() for _ in range(3)]  # three blocks announced
    assert eng.scheduler.preempt_newest() is not None  # as block pressure would
    assert eng.block_manager.num_used_blocks == 3  # the pins keep the announced blocks
    steps += _steps(eng)
    progress = [o for step in steps for o in step if o.streamed_block_ids is not None]
    (first,) = [o for step in steps for o in step if o.new_token_ids]
    announced = progress[-1].streamed_block_ids
    assert announced is not None and first.held_block_ids is not None
    assert first.held_block_ids[: len(announced)] == announced  # never re-announced elsewhere
    assert len(first.held_block_ids) == 7 and first.new_token_ids == [token]
    assert torch.equal(eng.runner.kv_cache[first.held_block_ids], ref_kv)
    eng.check_integrity()
    assert eng.release("s")
    _assert_idle_clean(eng)


def test_an_abort_while_streaming_keeps_the_pins_until_the_release() -> None:
    eng = _engine()
    eng.add(EngineRequest("s", _prompt(100), greedy(4)))
    eng.step()
    eng.step()  # two chunks: two blocks announced and pinned
    assert eng.abort_request("s")
    (final,) = eng.step()
    assert final.finished and final.finish_reason == "abort"
    assert eng.block_manager.num_used_blocks == 2  # a lease may still be reading them
    with pytest.raises(ValueError, match="already exists"):
        eng.add(EngineRequest("s", _prompt(40), greedy(2)))  # its pins are still held under the id
    eng.check_integrity()
    assert eng.release("s")
    _assert_idle_clean(eng)


def test_a_lease_ending_mid_prefill_ends_the_request_and_frees_everything() -> None:
    eng = _engine()
    eng.add(EngineRequest("s", _prompt(100), greedy(4)))
    for _ in range(3):
        eng.step()
    assert eng.release("s")  # the lease expired or the decode side gave up
    outs = [o for step in _steps(eng) for o in step]
    assert [o.finish_reason for o in outs] == ["abort"]
    _assert_idle_clean(eng)


def test_a_first_token_that_finishes_leaves_the_pins_to_the_release() -> None:
    eng = _engine()
    eng.add(EngineRequest("s", _prompt(100), greedy(1)))
    outs = [o for step in _steps(eng) for o in step]
    assert outs[-1].finish_reason == "length" and outs[-1].held_block_ids is None
    assert eng.block_manager.num_used_blocks == 6  # the announced blocks, pinned
    assert eng.release("s")
    _assert_idle_clean(eng)


def test_other_requests_in_the_batch_are_untouched() -> None:
    prompts = {"a": _prompt(20, 1), "b": _prompt(45, 4)}
    ref = LLMEngine(fake_config(), role="colocated")
    for rid, prompt in prompts.items():
        ref.add(EngineRequest(rid, prompt, greedy(6)))
    expected = run_until_done(ref)
    eng = LLMEngine(fake_config(**STREAM), role="colocated")  # colocated: the key is inert
    for rid, prompt in prompts.items():
        eng.add(EngineRequest(rid, prompt, greedy(6)))
    assert run_until_done(eng) == expected
    eng.check_integrity()
