"""Continuous batching, chunked prefill, preemption and FCFS, driven step by step.

Uses the fake runner (real block manager and scheduler, deterministic tiny "model" whose next
token depends on the KV read back from the cache). Every test ends with the integrity check.
"""

from __future__ import annotations

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.request import RequestStatus
from tests.helpers import fake_config, greedy, prefilled, run_until_done


def _engine(role: str = "colocated", **overrides: object) -> LLMEngine:
    return LLMEngine(fake_config(**overrides), role=role)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 7 + i * 13) % 500 for i in range(n)]


def _assert_idle_clean(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.requests and eng.stats()["num_held"] == 0


def _oracle(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """The same prompts run one at a time on a large pool: the reference output."""
    out = {}
    for rid, p in prompts.items():
        eng = _engine(
            **{
                "cache.num_blocks": 256,
                "scheduler.chunk_size": None,
                "scheduler.max_num_batched_tokens": 4096,
            }
        )
        eng.add(EngineRequest(rid, p, greedy(max_tokens)))
        out.update(run_until_done(eng))
    return out


def test_requests_join_a_running_batch_and_share_steps() -> None:
    eng = _engine()
    eng.add(EngineRequest("a", _prompt(10), greedy(20)))
    for _ in range(3):
        eng.step()
    eng.add(EngineRequest("b", _prompt(40, 1), greedy(5)))
    batch = eng.schedule()
    # "a" decodes (1 token) in the same step as "b"'s first prefill chunk (16 tokens).
    sizes = {it.request.request_id: it.num_new_tokens for it in batch.items}
    assert sizes == {"a": 1, "b": 16}
    eng.update(batch, eng.runner.execute(batch))
    eng.abort_request("a")
    eng.abort_request("b")
    eng.step()
    _assert_idle_clean(eng)


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    eng = _engine(**{"scheduler.max_num_seqs": 3, "scheduler.max_num_batched_tokens": 20})
    for i in range(6):
        eng.add(EngineRequest(f"r{i}", _prompt(30, i), greedy(4)))
    max_running = 0
    while eng.has_unfinished_requests():
        batch = eng.schedule()
        assert batch.num_batched_tokens <= 20
        assert len(eng.scheduler.running) <= 3
        max_running = max(max_running, len(eng.scheduler.running))
        eng.update(batch, eng.runner.execute(batch) if batch.items else None)
    assert max_running == 3
    _assert_idle_clean(eng)


def test_fcfs_admission_order() -> None:
    eng = _engine(**{"scheduler.max_num_seqs": 1})
    for i in range(4):
        eng.add(EngineRequest(f"r{i}", _prompt(5, i), greedy(3)))
    order = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
    assert order == ["r0", "r1", "r2", "r3"]
    _assert_idle_clean(eng)


def test_chunked_output_equals_unchunked_and_oracle() -> None:
    prompts = {f"r{i}": _prompt(n, i) for i, n in enumerate([3, 17, 33, 64, 90])}
    ref = _oracle(prompts, 12)
    for chunk in (4, 16, None):
        over = {"scheduler.chunk_size": chunk}
        if chunk is None:
            over["scheduler.max_num_batched_tokens"] = 4096
        eng = _engine(**over)
        for rid, p in prompts.items():
            eng.add(EngineRequest(rid, p, greedy(12)))
        assert run_until_done(eng) == ref
        _assert_idle_clean(eng)


def test_preemption_under_pressure_is_exact_and_never_deadlocks() -> None:
    prompts = {f"r{i}": _prompt(40, i) for i in range(8)}
    ref = _oracle(prompts, 24)
    eng = _engine(**{"cache.num_blocks": 12})  # 8 requests x 4 blocks do not fit
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(24)))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        eng.block_manager.check_integrity()  # the invariant holds at every step
        steps += 1
        assert steps < 5000
    assert eng.scheduler.num_preemptions > 0
    assert tokens == ref
    _assert_idle_clean(eng)


def test_forced_preemption_churn_keeps_outputs_exact() -> None:
    prompts = {f"r{i}": _prompt(20 + i, i) for i in range(6)}
    ref = _oracle(prompts, 16)
    eng = _engine(**{"testing.enabled": True, "testing.force_preempt_interval": 3})
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(16)))
    assert run_until_done(eng) == ref
    assert eng.scheduler.num_preemptions > 3
    _assert_idle_clean(eng)


def test_prefix_cache_hit_skips_computation_and_keeps_output() -> None:
    eng = _engine()
    p = _prompt(50)
    eng.add(EngineRequest("a", p, greedy(8)))
    first = run_until_done(eng)["a"]
    eng.add(EngineRequest("b", p, greedy(8)))
    batch = eng.schedule()
    (item,) = batch.items
    assert item.request.num_cached_tokens == 48  # 3 full blocks; the last token is recomputed
    assert item.num_new_tokens == 2
    eng.update(batch, eng.runner.execute(batch))
    eng.abort_request("b")
    eng.add(EngineRequest("c", p, greedy(8)))
    assert run_until_done(eng)["c"] == first
    _assert_idle_clean(eng)


def test_a_prefix_being_computed_is_waited_for_not_computed_twice() -> None:
    # Budget for all three at once: without the dedup "b" would prefill the shared 48 tokens too.
    eng = _engine(**{"scheduler.max_num_batched_tokens": 128, "scheduler.chunk_size": 32})
    shared = _prompt(48)
    prompts = {"a": shared + _prompt(6, 1), "b": shared + _prompt(9, 2), "c": _prompt(20, 3)}
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(6)))
    out: dict[str, list[int]] = {}

    def step() -> None:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)

    step()
    # "a" computed the first 32 shared tokens; "b" waits for the rest; "c" (no overlap) went on.
    computed = {rid: r.num_computed_tokens for rid, r in eng.requests.items()}
    assert computed == {"a": 32, "b": 0, "c": 20}
    assert eng.requests["b"].status == RequestStatus.WAITING
    step()  # "a" finishes its prompt and publishes the third shared block
    step()  # "b" is admitted: the whole shared prefix is a cache hit
    assert eng.requests["b"].num_cached_tokens == 48
    for rid, tokens in run_until_done(eng).items():
        out.setdefault(rid, []).extend(tokens)
    assert out == _oracle(prompts, 6)
    _assert_idle_clean(eng)


def test_the_dedup_wait_ends_when_the_computing_request_goes_away() -> None:
    eng = _engine()
    shared = _prompt(64)
    eng.add(EngineRequest("a", [*shared, 7], greedy(4)))
    eng.add(EngineRequest("b", [*shared, 9], greedy(4)))
    eng.step()
    assert eng.requests["b"].status == RequestStatus.WAITING
    eng.abort_request("a")  # its blocks will never all be published: "b" computes them itself
    out = run_until_done(eng)
    assert out["b"] == _oracle({"b": [*shared, 9]}, 4)["b"]
    _assert_idle_clean(eng)


def test_abort_in_every_state_frees_everything() -> None:
    eng = _engine(**{"scheduler.max_num_seqs": 2})
    eng.add(EngineRequest("run", _prompt(8), greedy(50)))
    eng.add(EngineRequest("pre", _prompt(60, 1), greedy(50)))
    eng.add(EngineRequest("wait", _prompt(8, 2), greedy(50)))
    for _ in range(3):
        eng.step()
    assert eng.requests["run"].status == RequestStatus.RUNNING
    assert eng.requests["wait"].status == RequestStatus.WAITING
    for rid in ["run", "pre", "wait"]:
        eng.abort_request(rid)
    assert not eng.abort_request("unknown")
    outs = eng.step()
    assert {o.request_id for o in outs if o.finished} == {"run", "pre", "wait"}
    _assert_idle_clean(eng)


def test_abort_while_waiting_for_kv_or_held_frees_everything() -> None:
    dec = _engine("decode", **{"scheduler.max_num_seqs": 2})
    dec.add(EngineRequest("kv-queued", _prompt(20, 3), greedy(50), prefill="remote"))
    dec.add(EngineRequest("kv-reserved", _prompt(20, 5), greedy(50), prefill="remote"))
    dec.add(EngineRequest("kv-waiting", _prompt(20, 6), greedy(50), prefill="remote"))
    dec.step()  # two get blocks (max_num_seqs), the third has none yet
    assert len(dec.take_reservations()) == 2
    pre = _engine("prefill")
    pre.add(EngineRequest("held", _prompt(20, 4), greedy(50)))
    run_until_done(pre)
    assert pre.stats()["num_held"] == 1
    for rid in ["kv-queued", "kv-reserved", "kv-waiting"]:
        assert dec.abort_request(rid)
    assert pre.abort_request("held") and not pre.abort_request("held")
    assert {o.request_id for o in dec.step() if o.finished} == {
        "kv-queued",
        "kv-reserved",
        "kv-waiting",
    }
    _assert_idle_clean(dec)
    _assert_idle_clean(pre)


def test_prefill_role_holds_blocks_until_released() -> None:
    eng = _engine("prefill")
    p = _prompt(37)
    eng.add(EngineRequest("p", p, greedy(10)))
    (out,) = [o for o in run_until_done_outputs(eng) if o.request_id == "p"]
    assert out.finished and out.finish_reason is None and len(out.new_token_ids) == 1
    held = out.held_block_ids
    assert held is not None and len(held) == 3  # 37 prompt tokens -> 3 blocks
    assert eng.stats()["kv"]["num_used_blocks"] == 3
    eng.check_integrity()
    assert eng.release("p")
    assert not eng.release("p")
    _assert_idle_clean(eng)


def test_prefill_role_first_token_that_finishes_frees_at_once() -> None:
    eng = _engine("prefill")
    eng.add(EngineRequest("one", _prompt(20), greedy(1)))
    (out,) = run_until_done_outputs(eng)
    assert out.finished and out.finish_reason == "length" and out.held_block_ids is None
    _assert_idle_clean(eng)


def run_until_done_outputs(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    return outs


def test_decode_role_with_kv_copied_in_equals_local_run() -> None:
    """Prefill on one engine, copy the held blocks into another's reservation, decode there."""
    p = _prompt(45)
    local = _engine()
    local.add(EngineRequest("x", p, greedy(12)))
    expected = run_until_done(local)["x"]

    pre, dec = _engine("prefill"), _engine("decode", **{"cache.num_blocks": 40})
    first, first_tokens = prefilled(pre, EngineRequest("x", p, greedy(12), seed=7))
    src = first.held_block_ids
    assert src is not None and first_tokens[0].token_id == first.new_token_ids[0]

    decision = dec.add(EngineRequest("x", p, greedy(12), prefill="remote", seed=7))
    assert decision.remote and decision.num_cached_tokens == 0
    dec.step()
    (res,) = dec.take_reservations()
    assert res.num_hit_blocks == 0 and len(res.block_ids) == len(src)
    dec.runner.kv_cache[res.block_ids] = pre.runner.kv_cache[src]
    assert pre.release("x")
    assert dec.kv_arrived("x", first_tokens) == []  # taken in: no output for it here
    rest = run_until_done(dec)["x"]
    assert first.new_token_ids + rest == expected
    _assert_idle_clean(pre)
    _assert_idle_clean(dec)


def test_decode_role_reserves_a_remote_requests_blocks_at_admission() -> None:
    """No step needed: the prefill call waits for these blocks, and a step may be long."""
    dec = _engine("decode")
    assert dec.add(EngineRequest("x", _prompt(40), greedy(8), prefill="remote")).remote
    (res,) = dec.take_reservations()
    assert res.request_id == "x" and len(res.block_ids) == 3  # 40 + the first token: 3 blocks
    assert dec.abort_request("x")
    dec.step()
    _assert_idle_clean(dec)


def test_a_reservation_at_admission_leaves_the_running_batchs_next_blocks_free() -> None:
    dec = _engine("decode", **{"cache.num_blocks": 6})
    # local: 2 blocks, then a 3rd for its 33rd token
    dec.add(EngineRequest("run", _prompt(32, 1), greedy(20)))
    while not dec.requests["run"].output_token_ids:
        dec.step()
    assert dec.block_manager.num_free_blocks == 4
    # needs 4: "run" needs 1 of them
    dec.add(EngineRequest("x", _prompt(63, 2), greedy(8), prefill="remote"))
    assert dec.take_reservations() == []
    dec.step()
    assert dec.scheduler.num_preemptions == 0 and dec.take_reservations() == []
    while "run" in dec.requests:  # its blocks return when it ends; a step reserves them then
        dec.step()
    dec.step()
    (res,) = dec.take_reservations()
    assert res.request_id == "x" and dec.scheduler.num_preemptions == 0
    assert dec.abort_request("x")
    dec.step()
    _assert_idle_clean(dec)


def test_decode_role_reuses_its_own_prefix_cache() -> None:
    p = _prompt(40)
    dec = _engine("decode")
    dec.add(EngineRequest("warm", p, greedy(2)))
    run_until_done(dec)
    decision = dec.add(EngineRequest("y", [*p, 5, 6, 7], greedy(4), prefill="remote"))
    assert decision.num_cached_tokens == 32
    dec.step()
    (res,) = dec.take_reservations()
    assert res.num_hit_blocks == 2  # 40 tokens -> 2 full cached blocks; the 3rd must move
    dec.abort_request("y")
    dec.step()
    _assert_idle_clean(dec)


def test_failed_transfer_falls_back_to_exact_local_prefill() -> None:
    p = _prompt(30)
    ref = _oracle({"z": p}, 10)["z"]
    dec = _engine("decode")
    dec.add(EngineRequest("z", p, greedy(10), prefill="remote"))
    dec.step()
    dec.take_reservations()
    dec.kv_failed("z", recompute=True)
    assert run_until_done(dec)["z"] == ref
    _assert_idle_clean(dec)
    dec.add(EngineRequest("w", p, greedy(10), prefill="remote"))
    dec.step()
    dec.kv_failed("w", recompute=False, error="peer gone")
    outs = run_until_done_outputs(dec)
    assert any(o.request_id == "w" and o.finish_reason == "error" for o in outs)
    _assert_idle_clean(dec)


def test_decode_role_decides_local_or_remote_by_what_it_has_cached() -> None:
    # decode.local_prefill_threshold: at most that many uncached tokens prefill here.
    dec = _engine("decode", **{"decode.local_prefill_threshold": 16})
    p = _prompt(64)
    assert dec.add(EngineRequest("far", p, greedy(2), prefill="auto")).remote  # 64 uncached > 16
    dec.abort_request("far")
    dec.add(EngineRequest("warm", p, greedy(2)))
    run_until_done(dec)
    near = dec.add(EngineRequest("near", [*p, 9, 9, 9], greedy(2), prefill="auto"))  # 3 uncached
    assert not near.remote and near.num_cached_tokens == 64
    run_until_done(dec)
    _assert_idle_clean(dec)


def test_a_role_api_on_the_wrong_role_is_refused() -> None:
    eng = _engine()
    try:
        eng.add(EngineRequest("x", _prompt(8), greedy(2), prefill="remote"))
    except ValueError as e:
        assert "decode role" in str(e)
    else:
        raise AssertionError("remote prefill on a colocated engine must be refused")
    _assert_idle_clean(eng)
