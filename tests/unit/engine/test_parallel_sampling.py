"""Parallel sampling (``n > 1``, ``cluster.engine.parallel``): n samples on the prompt's blocks.

The bound of issue 11: n = 8 on a 512-token prompt holds <= 1.15x the KV blocks of one prompt
plus 8 outputs; greedy samples are identical; each sample is token for token a separate request
with its own seed (tiny random Llama); seeded outputs repeat; cancelling frees every sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.parallel import sample_ids, sample_seed
from tests.helpers import fake_config, greedy, prefilled, run_until_done, tiny_config


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 7 + i * 13) % 500 for i in range(n)]


def _sampled(max_tokens: int, seed: int | None = 11) -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def _idle_clean(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.requests and eng.stats()["num_samples_waiting"] == 0


def _run_peak(eng: LLMEngine) -> tuple[dict[str, list[int]], int]:
    tokens: dict[str, list[int]] = {}
    peak = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        peak = max(peak, eng.block_manager.num_used_blocks)
        eng.check_integrity()
    return tokens, peak


@pytest.mark.parametrize("max_tokens", [64, 16])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len", [512, 500])
def test_n8_on_a_512_token_prompt_holds_the_block_bound(
    caching: bool, prompt_len: int, max_tokens: int
) -> None:
    """512 tokens fill their last block: the samples share all 32 prompt blocks, nothing is
    recomputed; 500 do not: each sample recomputes its 4-token tail into a block of its own
    (what copying the partial block would hold)."""
    overrides = {
        "cache.num_blocks": 400,
        "cache.enable_prefix_caching": caching,
        "model.max_model_len": 1024,
        "scheduler.max_num_seqs": 16,
    }
    eng = LLMEngine(fake_config(**overrides))
    eng.add(EngineRequest("r", _prompt(prompt_len), _sampled(max_tokens), n=8))
    fed: list[int] = []
    execute = eng.runner.execute
    eng.runner.execute = lambda b: fed.append(b.num_batched_tokens) or execute(b)  # type: ignore[method-assign]
    tokens, peak = _run_peak(eng)
    # The prompt once, then 8 x (max_tokens - 1) decodes; a partial last block adds 7 tails.
    tails = 7 * (prompt_len % 16)
    assert sum(fed) == prompt_len + tails + 8 * (max_tokens - 1), sum(fed)
    assert sorted(tokens) == sorted(sample_ids("r", 8))
    assert all(len(t) == max_tokens for t in tokens.values())
    bm = eng.block_manager
    one_prompt_plus_8_outputs = bm.blocks_needed(prompt_len) + 8 * bm.blocks_needed(max_tokens)
    if prompt_len == 512 or max_tokens == 64:  # the bound (512: at any output length)
        assert peak <= 1.15 * one_prompt_plus_8_outputs, (peak, one_prompt_plus_8_outputs)
    # Unshared, the 8 samples would hold 8 prompts.
    assert peak < 8 * bm.blocks_needed(prompt_len + max_tokens) / 3
    if prompt_len % bm.block_size == 0:  # copy-on-write's count: nothing to copy
        assert peak == one_prompt_plus_8_outputs, (peak, one_prompt_plus_8_outputs)
    else:  # one own (tail) block per sample, its outputs continuing in it: 500 tokens with
        # 16-token outputs hold 47 blocks, 1.175x, as copying the tail block would (31 shared,
        # then 4 prompt + 12 output tokens in each copy and 4 more in a block after it)
        tail = prompt_len % bm.block_size
        own = bm.blocks_needed(tail + max_tokens)
        assert peak == bm.blocks_needed(prompt_len) - 1 + 8 * own, peak
    assert eng.stats()["num_prompt_tokens"] == prompt_len  # the prompt counts once
    _idle_clean(eng)


def test_greedy_samples_are_identical_and_match_n1() -> None:
    eng = LLMEngine(fake_config())
    eng.add(EngineRequest("one", _prompt(37), greedy(20)))
    expected = run_until_done(eng)["one"]
    eng.add(EngineRequest("many", _prompt(37), greedy(20), n=5))
    outs = run_until_done(eng)
    assert [outs[rid] for rid in sample_ids("many", 5)] == [expected] * 5
    _idle_clean(eng)


def test_outputs_carry_their_sample_index() -> None:
    eng = LLMEngine(fake_config())
    eng.add(EngineRequest("r", _prompt(20), _sampled(6), n=3))
    seen: dict[str, set[int]] = {}
    finished = set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.setdefault(out.request_id, set()).add(out.index)
            if out.finished:
                finished.add(out.index)
    assert seen == {"r": {0}, "r#1": {1}, "r#2": {2}} and finished == {0, 1, 2}
    _idle_clean(eng)


def test_seeded_samples_repeat_and_differ_from_each_other() -> None:
    def run() -> list[list[int]]:
        eng = LLMEngine(fake_config())
        eng.add(EngineRequest("r", _prompt(45), _sampled(24, seed=1234), n=4))
        out = run_until_done(eng)
        _idle_clean(eng)
        return [out[rid] for rid in sample_ids("r", 4)]

    first = run()
    assert run() == first
    assert len({tuple(t) for t in first}) > 1  # each sample its own stream


def _tiny(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine(tiny_config(model_dir, **{"cache.num_blocks": 256, **overrides}))


@pytest.mark.parametrize("prompt_len", [32, 45])  # the last block full, or partial
def test_each_sample_is_a_separate_request_with_its_seed(
    tiny_model_dir: Path, prompt_len: int
) -> None:
    """Exactness on a real (tiny random) Llama: sample i of a seeded n = 4 request equals a
    request of its own with seed ``sample_seed(seed, i)``, computed before, without sharing."""
    ref = _tiny(tiny_model_dir, **{"cache.enable_prefix_caching": False})
    prompt = [3 + (i * 7) % 400 for i in range(prompt_len)]
    params = _sampled(12, seed=None)
    for i in range(4):
        ref.add(EngineRequest(f"alone{i}", prompt, params, seed=sample_seed(99, i)))
    alone = run_until_done(ref)
    expected = [alone[f"alone{i}"] for i in range(4)]

    eng = _tiny(tiny_model_dir)
    eng.add(EngineRequest("r", prompt, params, seed=99, n=4))
    tokens, peak = _run_peak(eng)
    assert [tokens[rid] for rid in sample_ids("r", 4)] == expected
    assert peak < 4 * eng.block_manager.blocks_needed(prompt_len + 12)  # shared, not 4 prompts
    _idle_clean(eng)


@pytest.mark.parametrize("prompt_len", [130, 128])  # the last block partial, or full
@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_cancelling_frees_every_sample(when: str, prompt_len: int) -> None:
    eng = LLMEngine(fake_config(**{"cache.num_blocks": 200, "scheduler.max_num_seqs": 16}))
    eng.add(EngineRequest("keep", _prompt(30, 1), greedy(40)))
    eng.add(EngineRequest("r", _prompt(prompt_len), _sampled(40), n=8))
    finals: dict[str, str | None] = {}
    steps = {"waiting": 0, "prefilling": 2, "decoding": 14}[when]
    for _ in range(steps):
        for out in eng.step():
            assert not out.finished
    if when == "decoding":
        assert eng.stats()["num_samples_waiting"] == 0  # all 8 forked and running
    assert eng.abort_request("r")
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert finals == {**dict.fromkeys(sample_ids("r", 8), "abort"), "keep": "length"}
    _idle_clean(eng)


def test_bad_n_is_refused_naming_the_field() -> None:
    eng = LLMEngine(fake_config())
    for bad in (0, -1, 17, True, 2.0):
        with pytest.raises(ValueError, match="^n: "):
            eng.add(EngineRequest("x", [1, 2, 3], greedy(2), n=bad))  # type: ignore[arg-type]
    eng.add(EngineRequest("x", [1, 2, 3], greedy(2), n=2))
    with pytest.raises(ValueError, match="^request_id: 'x#1' already exists"):
        eng.add(EngineRequest("x#1", [1, 2, 3], greedy(2)))
    run_until_done(eng)
    _idle_clean(eng)


@pytest.mark.parametrize("prompt_len", [45, 48])  # the last block partial, or full
def test_decode_role_forks_the_samples_from_the_one_pulled_prompt(prompt_len: int) -> None:
    """PD on one decode engine: the leader's KV is copied in once (one prefill, one transfer);
    the other samples fork from it when it arrives, and equal a colocated run. A full last
    block: the prefill engine draws the samples' first tokens too, and none is recomputed."""
    p = _prompt(prompt_len)
    params = _sampled(10)
    local = LLMEngine(fake_config())
    local.add(EngineRequest("x", p, params, seed=7, n=3))
    expected = run_until_done(local)

    pre = LLMEngine(fake_config(), role="prefill")
    dec = LLMEngine(fake_config(**{"cache.num_blocks": 40}), role="decode")
    first, first_tokens = prefilled(pre, EngineRequest("x", p, params, seed=7, n=3))
    assert first.held_block_ids is not None
    full = prompt_len % 16 == 0
    assert len(first_tokens) == (3 if full else 1)  # the samples' too, with a full last block
    assert dec.add(EngineRequest("x", p, params, prefill="remote", seed=7, n=3)).remote
    dec.step()
    (res,) = dec.take_reservations()  # one reservation, one transfer, for the three samples
    held = first.held_block_ids  # the reservation has room for the first token's KV too
    dec.runner.kv_cache[res.block_ids[: len(held)]] = pre.runner.kv_cache[held]
    assert pre.release("x")
    assert dec.stats()["num_samples_waiting"] == 2
    assert dec.kv_arrived("x", first_tokens) == []  # one entry, every first token
    fed: list[int] = []
    execute = dec.runner.execute
    dec.runner.execute = lambda b: fed.append(b.num_batched_tokens) or execute(b)  # type: ignore[method-assign]
    rest = run_until_done(dec)  # nothing again of the first tokens handed in
    for sid, token in zip(sample_ids("x", 3), first_tokens):
        rest[sid] = [token.token_id, *rest[sid]]
    assert rest == expected
    # Decode steps only (9 more tokens each), plus each sample's recomputed tail if partial.
    assert sum(fed) == 3 * 9 + (0 if full else 2 * (prompt_len % 16))
    assert dec.stats()["num_prompt_tokens"] == len(p)
    _idle_clean(dec)
    pre.check_integrity()
    assert pre.block_manager.num_used_blocks == 0


def test_samples_stay_exact_under_forced_preemption() -> None:
    def run(**overrides: Any) -> dict[str, list[int]]:
        eng = LLMEngine(fake_config(**overrides))
        eng.add(EngineRequest("r", _prompt(70), _sampled(20), n=4))
        eng.add(EngineRequest("s", _prompt(40, 3), _sampled(20, seed=4), n=3))
        out = run_until_done(eng)
        _idle_clean(eng)
        return out

    churned = run(**{"testing.force_preempt_interval": 3})
    assert churned == run()


def test_a_leader_ended_by_its_first_token_leaves_its_samples_to_run() -> None:
    eng = LLMEngine(fake_config())
    eng.add(EngineRequest("one", _prompt(40), _sampled(1), n=4))
    out = run_until_done(eng)
    assert sorted(out) == sorted(sample_ids("one", 4)) and all(len(t) == 1 for t in out.values())
    _idle_clean(eng)


def test_a_failed_transfer_recomputes_the_leader_and_then_forks() -> None:
    p = _prompt(45)
    local = LLMEngine(fake_config())
    local.add(EngineRequest("x", p, _sampled(8), seed=7, n=3))
    expected = run_until_done(local)
    dec = LLMEngine(fake_config(), role="decode")
    dec.add(EngineRequest("x", p, _sampled(8), prefill="remote", seed=7, n=3))
    dec.step()
    assert len(dec.take_reservations()) == 1
    dec.kv_failed("x", recompute=True)
    assert run_until_done(dec) == expected
    _idle_clean(dec)


def test_a_failed_pull_after_the_first_tokens_recomputes_after_them() -> None:
    """The client has every sample's first token from the prefill reply when the pull fails:
    the engine takes them in with ``kv_failed``, recomputes the prompt and those tokens'
    KV, and goes on from there: every sample equals a colocated run, no first token twice."""
    p = _prompt(48)  # a full last block: the prefill engine draws the samples' first tokens
    local = LLMEngine(fake_config())
    local.add(EngineRequest("x", p, _sampled(8), seed=7, n=3))
    expected = run_until_done(local)
    pre = LLMEngine(fake_config(), role="prefill")
    _first, first_tokens = prefilled(pre, EngineRequest("x", p, _sampled(8), seed=7, n=3))
    assert len(first_tokens) == 3 and pre.release("x")
    dec = LLMEngine(fake_config(), role="decode")
    dec.add(EngineRequest("x", p, _sampled(8), prefill="remote", seed=7, n=3))
    dec.step()
    assert len(dec.take_reservations()) == 1
    assert dec.kv_failed("x", recompute=True, first_tokens=first_tokens) == []
    rest = run_until_done(dec)
    for sid, token in zip(sample_ids("x", 3), first_tokens):
        rest[sid] = [token.token_id, *rest[sid]]
    assert rest == expected
    _idle_clean(dec)


def test_a_failed_transfer_without_recompute_fails_every_sample() -> None:
    dec = LLMEngine(fake_config(), role="decode")
    dec.add(EngineRequest("x", _prompt(45), _sampled(8), prefill="remote", n=3))
    dec.step()
    dec.kv_failed("x", recompute=False, error="KV transfer failed")
    errors = {o.request_id: o.error for o in dec.step() if o.finished}
    assert errors == dict.fromkeys(sample_ids("x", 3), "KV transfer failed")
    _idle_clean(dec)
