"""Speculative decoding in the engine: prompt lookup, exact verification, rollback, adaptivity.

Greedy with drafts must be token-identical to greedy without, whatever the proposer proposes
(right, wrong, half right, prompt lookup), through chunked prefill, prefix-cache hits and
forced preemption; sampled runs reproduce with the seed, and stop conditions apply per accepted
token. Every lifecycle test ends idle, with the integrity check and no block held.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.config import SPECULATIVE_METHODS, load_config
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.spec import PROPOSERS, NgramProposer
from cluster.engine.spec.proposer import Drafts, lookup
from cluster.engine.spec.step_cost import StepCost
from tests.helpers import fake_config, greedy, make_config, run_until_done
from tests.spec_helpers import FakeModeProposer, ScriptedProposer, use_proposer

# The row cost held at its prior (0.1): these tests count drafts (StepCost has its own tests).
SPEC = {
    "decode.speculative.method": "ngram",
    "decode.speculative.num_speculative_tokens": 5,
    "decode.speculative.measure_row_cost": False,
}


def _finish_clean(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.speculator._tracks  # per-request state forgotten with the request


def _run(eng: LLMEngine, prompts: dict[str, list[int]], params: Any) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, params(rid) if callable(params) else params))
    out = run_until_done(eng)
    _finish_clean(eng)
    return out


# -- the proposer ---------------------------------------------------------------------------------


def test_lookup_takes_the_longest_suffix_then_the_most_recent_occurrence() -> None:
    # "2 3" occurs twice before the suffix; the later one (followed by 7) wins.
    assert lookup(np.array([1, 2, 3, 9, 5, 2, 3, 7, 8, 2, 3]), 2, 4, 3) == [7, 8, 2]
    # "1 2 3" (3 long) beats the more recent "2 3".
    assert lookup(np.array([1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]), 2, 4, 2) == [9, 5]
    # At most max_ngram is compared: with max 2 the most recent "2 3" wins again.
    assert lookup(np.array([1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]), 2, 2, 2) == [7, 8]
    # Nothing shorter than min_ngram; a continuation may run into the suffix itself.
    assert lookup(np.array([4, 5, 6, 4]), 2, 4, 3) == []
    assert lookup(np.array([4, 5, 6, 4]), 1, 4, 3) == [5, 6, 4]
    assert lookup(np.array([7, 7, 7]), 2, 4, 5) == [7]
    assert lookup(np.array([1, 2]), 2, 4, 3) == []
    assert lookup(np.array([1, 2, 3, 4]), 1, 4, 3) == []


def test_the_ngram_proposer_reads_only_the_tokens() -> None:
    eng = LLMEngine(fake_config())
    eng.add(EngineRequest("a", [10, 11, 12, 13, 10, 11], greedy(4)))
    req = eng.requests["a"]
    proposer = NgramProposer(load_config(overrides=SPEC).decode.speculative)
    assert proposer.propose([req], [3]) == [[12, 13, 10]]
    assert proposer.propose([req], [0]) == [[]]
    eng.abort_request("a")
    eng.step()
    _finish_clean(eng)


# -- greedy: token-identical ----------------------------------------------------------------------


COPY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "def add(a, b): return a + b. The rain in Spain stays mainly in the plain. "
)


def _tiny(model_dir: Path, spec: bool, **overrides: Any) -> LLMEngine:
    base = {
        "model.path": str(model_dir),
        "model.num_threads": 1,
        "scheduler.chunk_size": 16,
        "scheduler.max_num_batched_tokens": 64,
        "cache.num_blocks": 256,
        "testing.enabled": True,
    }
    base.update(SPEC if spec else {})
    base.update(overrides)
    return LLMEngine(make_config(**base))


@pytest.fixture(scope="module")
def tiny_workload(tiny_model_dir: Path) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    eng = _tiny(tiny_model_dir, spec=False)
    tok = eng.tokenizer
    words = COPY_TEXT.split()
    prompts = {f"q{i}": tok.encode(" ".join(words[i : i + 6 + 5 * i])) for i in range(5)}
    copy = tok.encode(COPY_TEXT)
    prompts.update({f"c{i}": copy + copy[: 8 + 9 * i] for i in range(3)})  # copy-heavy
    shared = tok.encode(COPY_TEXT * 2)[:48]  # three full blocks shared: prefix-cache hits
    prompts.update({f"s{i}": shared + tok.encode(f" number {i}") for i in range(2)})
    assert len(prompts) >= 8
    return prompts, _run(eng, prompts, greedy(24))


@pytest.mark.parametrize("proposer", ["ngram", "right", "wrong", "half"])
def test_greedy_with_drafts_equals_greedy_without(
    tiny_model_dir: Path, tiny_workload: Any, proposer: str
) -> None:
    prompts, expected = tiny_workload
    eng = _tiny(tiny_model_dir, spec=True)
    if proposer != "ngram":
        wrong = {"right": 0.0, "wrong": 1.0, "half": 0.5}[proposer]
        use_proposer(eng, ScriptedProposer(expected, eng.vocab_size, wrong))
    # Twice: the second round hits the prefix cache the first one filled (drafts never land in
    # it: only verified tokens' blocks are published).
    for round_ in ("a", "b"):
        got = _run(eng, {f"{rid}#{round_}": p for rid, p in prompts.items()}, greedy(24))
        assert {rid.split("#")[0]: toks for rid, toks in got.items()} == expected
    spec = eng.stats()["spec"]
    assert spec["num_verifications"] > 0
    if proposer == "right":
        assert spec["acceptance_rate"] == 1.0  # every draft accepted, then a bonus token
        assert eng.stats()["num_steps"] < 24 * 2
    if proposer == "wrong":
        assert spec["num_accepted_tokens"] == 0
    assert eng.stats()["num_cached_prompt_tokens"] > 0


def test_greedy_with_drafts_under_forced_preemption(
    tiny_model_dir: Path, tiny_workload: Any
) -> None:
    prompts, expected = tiny_workload
    eng = _tiny(tiny_model_dir, spec=True, **{"testing.force_preempt_interval": 3})
    use_proposer(eng, ScriptedProposer(expected, eng.vocab_size, wrong_share=0.3))
    assert _run(eng, prompts, greedy(24)) == expected
    assert eng.stats()["num_preemptions"] > 0
    assert eng.stats()["spec"]["num_accepted_tokens"] > 0


def test_drafts_never_cause_a_preemption() -> None:
    # A pool just big enough for the requests' own tokens: drafts take only spare slots.
    prompts = {f"r{i}": [1 + (i * 7 + j * 3) % 500 for j in range(30)] for i in range(3)}
    cfg = fake_config(**{"cache.num_blocks": 9, **SPEC})
    expected = _run(LLMEngine(fake_config(**{"cache.num_blocks": 9})), prompts, greedy(17))
    eng = LLMEngine(cfg)
    use_proposer(eng, ScriptedProposer(expected, eng.vocab_size))
    assert _run(eng, prompts, greedy(17)) == expected
    assert eng.stats()["num_preemptions"] == 0
    assert eng.stats()["spec"]["num_accepted_tokens"] > 0


# -- stop conditions and logprobs, per accepted token -------------------------------------------


def _outputs(eng: LLMEngine) -> dict[str, list[Any]]:
    outs: dict[str, list[Any]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    _finish_clean(eng)
    return outs


def test_stops_apply_to_each_accepted_token() -> None:
    prompt = [5, 6, 7, 8]
    ref = LLMEngine(fake_config())
    ref.add(EngineRequest("x", prompt, greedy(30)))
    tokens = run_until_done(ref)["x"]
    cases = {
        "stop_id": SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[9]]),
        "max_tokens": SamplingParams(temperature=0, max_tokens=7),
        "min_tokens": SamplingParams(
            temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[tokens[4]]
        ),
        "stop_str": SamplingParams(temperature=0, max_tokens=30, stop=[f"t{tokens[11]}"]),
        "logprobs": SamplingParams(temperature=0, max_tokens=20, logprobs=2),
    }
    results = {}
    for spec in (False, True):
        eng = LLMEngine(fake_config(**(SPEC if spec else {})))
        if spec:
            use_proposer(eng, ScriptedProposer({"x": tokens}, eng.vocab_size))
        for name, params in cases.items():
            eng.add(EngineRequest(f"x#{name}", prompt, params))
        results[spec] = _outputs(eng)
        if spec:
            assert eng.stats()["spec"]["num_accepted_tokens"] > 10
    for name in cases:
        rid = f"x#{name}"
        off, on = results[False][rid], results[True][rid]
        assert [t for o in on for t in o.new_token_ids] == [t for o in off for t in o.new_token_ids]
        assert "".join(o.new_text for o in on) == "".join(o.new_text for o in off), name
        assert on[-1].finish_reason == off[-1].finish_reason, name
        assert [lp for o in on for lp in o.new_logprobs or []] == [
            lp for o in off for lp in o.new_logprobs or []
        ]
        assert [t for o in on for t in o.new_top_logprobs or []] == [
            t for o in off for t in o.new_top_logprobs or []
        ]
        assert len(on) < len(off) or name == "max_tokens"  # several tokens per step
    on = results[True]
    assert len([t for o in on["x#stop_id"] for t in o.new_token_ids]) == 10
    assert len([t for o in on["x#max_tokens"] for t in o.new_token_ids]) == 7
    assert on["x#logprobs"][-1].num_accepted_tokens > 0


# -- sampled: reproducible with the seed --------------------------------------------------------


SAMPLED = [
    SamplingParams(temperature=1.0, max_tokens=40, seed=11, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=3, max_tokens=40, seed=12, ignore_eos=True),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, max_tokens=40, seed=13, ignore_eos=True),
    SamplingParams(
        temperature=1.0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        max_tokens=40,
        min_tokens=20,
        seed=14,
    ),
]


@pytest.mark.parametrize("mode", ["right", "half", "wrong"])
def test_sampled_runs_reproduce_with_the_seed(mode: str) -> None:
    prompts = {f"r{i}": [3 + (i * 13 + j * 5) % 500 for j in range(12 + 7 * i)] for i in range(4)}
    params = {rid: SAMPLED[i] for i, rid in enumerate(prompts)}
    expected = _run(LLMEngine(fake_config()), prompts, params.__getitem__)
    eng = LLMEngine(fake_config(**SPEC))
    use_proposer(eng, FakeModeProposer(eng.runner, mode, k=4))  # type: ignore[arg-type]
    assert _run(eng, prompts, params.__getitem__) == expected
    spec = eng.stats()["spec"]
    assert spec["num_verifications"] > 0
    assert (spec["num_accepted_tokens"] > 0) == (mode != "wrong")


# -- adaptivity and accounting ------------------------------------------------------------------


def test_low_acceptance_pauses_drafting_and_a_big_batch_drafts_nothing() -> None:
    prompts = {f"r{i}": [2 + (i * 17 + j) % 500 for j in range(10)] for i in range(4)}
    ref = _run(LLMEngine(fake_config()), prompts, greedy(60))
    eng = LLMEngine(fake_config(**SPEC))
    use_proposer(eng, ScriptedProposer(ref, eng.vocab_size, wrong_share=1.0))
    assert _run(eng, prompts, greedy(60)) == ref
    # Without the pauses every decode step of every request would verify (~60 each).
    assert eng.stats()["spec"]["num_verifications"] < 4 * 60 / 3
    eng = LLMEngine(fake_config(**SPEC, **{"decode.speculative.max_batch_size": 3}))
    scripted = ScriptedProposer(ref, eng.vocab_size)
    use_proposer(eng, scripted)
    assert _run(eng, prompts, greedy(60)) == ref
    # Four decoding together: no drafts until one finished... they all finish together.
    assert eng.stats()["spec"]["num_verifications"] == 0 and scripted.num_calls == 0


def _drafted_per_step(eng: LLMEngine) -> list[dict[str, int]]:
    """Records, for each step that drafts, how many drafts each request got."""
    steps: list[dict[str, int]] = []
    propose = eng.speculator.propose

    def recording(running: Any) -> dict[str, list[int]]:
        drafts = propose(running)
        if drafts:
            steps.append({rid: len(d) for rid, d in drafts.items()})
        return drafts

    eng.speculator.propose = recording  # type: ignore[method-assign]
    return steps


def test_a_step_drafts_at_most_its_budget_first_drafts_first_and_less_where_acceptance_is_low() -> (
    None
):
    prompts = {f"r{i}": [2 + (i * 17 + j) % 500 for j in range(10)] for i in range(4)}
    ref = _run(LLMEngine(fake_config()), prompts, greedy(40))
    budget = {
        "decode.speculative.max_num_draft_tokens": 7,
        "decode.speculative.min_acceptance_rate": 0.0,
    }
    eng = LLMEngine(fake_config(**SPEC, **budget))
    use_proposer(eng, ScriptedProposer(ref, eng.vocab_size, wrong_share=0.0))
    steps = _drafted_per_step(eng)
    assert _run(eng, prompts, greedy(40)) == ref
    assert steps and all(sum(s.values()) <= 7 for s in steps)
    # Four requests alike: each one's first draft outranks any second one (4 + 3 of 7).
    four = [s for s in steps if len(s) == 4]
    assert four and all(sorted(s.values()) == [1, 2, 2, 2] for s in four)
    eng = LLMEngine(fake_config(**SPEC, **{"decode.speculative.min_acceptance_rate": 0.0}))
    use_proposer(eng, ScriptedProposer(ref, eng.vocab_size, wrong_share=1.0))
    steps = _drafted_per_step(eng)
    assert _run(eng, {"r0": prompts["r0"]}, greedy(40)) == {"r0": ref["r0"]}
    k = eng.config.decode.speculative.num_speculative_tokens
    assert steps[0] == {"r0": k} and steps[-1] == {"r0": 1}  # all rejected: down to a probe


class _ClassedProposer(ScriptedProposer):
    """Right drafts from evidence class 8 for requests named ``sure*``, wrong ones from class 2
    for the others (the n-gram proposer's classes: matched lengths)."""

    def propose(self, requests: Any, max_drafts: Any) -> list[list[int]]:
        right = super().propose(requests, max_drafts)
        out: list[list[int]] = []
        for r, drafts in zip(requests, right, strict=True):
            if r.request_id.startswith("sure"):
                out.append(Drafts(drafts, 8))
            else:
                out.append(Drafts([(t + 1) % self.vocab_size for t in drafts], 2))
        return out


def test_drafts_of_a_surer_evidence_class_get_the_budget() -> None:
    prompts = {f"{name}{i}": [2 + (i * 17 + j) % 500 for j in range(10)]
               for i, name in enumerate(("sure", "doubt", "sure", "doubt"))}  # fmt: skip
    ref = _run(LLMEngine(fake_config()), prompts, greedy(40))
    eng = LLMEngine(fake_config(**SPEC, **{"decode.speculative.max_num_draft_tokens": 8}))
    use_proposer(eng, _ClassedProposer(ref, eng.vocab_size))
    steps = _drafted_per_step(eng)
    assert _run(eng, prompts, greedy(40)) == ref
    spec = eng.speculator
    assert spec.acceptance("new", 8) > 0.9 > 0.3 > spec.acceptance("new", 2)
    assert spec.acceptance("new", 5) == pytest.approx(0.8)  # an unseen class: the request's own
    # Once the classes are known, the doubtful requests only probe (one draft now and then).
    late = steps[len(steps) // 3 :]
    assert all(n == 1 for s in late for rid, n in s.items() if rid.startswith("doubt"))
    drafted = {name: sum(n for s in steps for rid, n in s.items() if rid.startswith(name))
               for name in ("sure", "doubt")}  # fmt: skip
    assert drafted["sure"] > 3 * drafted["doubt"], drafted
    assert eng.stats()["spec"]["acceptance_rate"] > 0.5


def test_drafts_replaced_after_the_proposal_do_not_count_for_its_class() -> None:
    """A grammar's forced tokens (``structured``) replace the proposed drafts: their outcome is
    not the proposer's evidence class's (it goes to class 0)."""
    prompts = {"sure0": [2 + j % 500 for j in range(10)]}
    ref = _run(LLMEngine(fake_config()), prompts, greedy(30))
    eng = LLMEngine(fake_config(**SPEC))
    use_proposer(eng, _ClassedProposer(ref, eng.vocab_size))
    drafts = eng.structured.drafts

    def replaced(running: Any, proposed: Any) -> Any:  # wrong tokens instead of the proposal
        return {
            rid: [(t + 7) % eng.vocab_size for t in d]
            for rid, d in drafts(running, proposed).items()
        }

    eng.structured.drafts = replaced  # type: ignore[method-assign]
    assert _run(eng, prompts, greedy(30)) == ref
    spec = eng.speculator
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == 0
    assert 8 not in spec._classes and spec._classes[0].p < 0.5


def test_a_draft_rows_cost_is_read_off_the_steps_apart_from_the_batchs() -> None:
    cost = StepCost(prior=0.1, min_steps=16)
    for i in range(40):  # no drafts (the batch varies): no draft cost to read, the prior stands
        cost.observe(1 + i % 8, 0, 0.008 + 0.002 * (1 + i % 8))
    assert cost.fit() is None and cost.threshold(1) == pytest.approx(0.1 / 1.1)
    # t = 8 ms + 2 ms a request + 4 ms a draft row (a draft computes more than a request adds)
    for i in range(60):
        requests, drafts = 1 + i % 8, (i * 5) % 7
        cost.observe(requests, drafts, 0.008 + 0.002 * requests + 0.004 * drafts)
    a, e, b = cost.fit() or (0.0, 0.0, 0.0)
    assert (a, e, b) == pytest.approx((0.008, 0.002, 0.004), rel=1e-6)
    assert cost.threshold(1) == pytest.approx(0.004 / 0.010)  # b B / t_B
    assert cost.threshold(8) == 0.99  # 32 ms of drafts on a 24 ms step: never worth it
    assert cost.row_cost == pytest.approx(0.4)
    # Every step with the same batch and drafts in proportion to it: b cannot be told apart.
    same = StepCost(prior=0.2, min_steps=4)
    for _ in range(30):
        same.observe(8, 24, 0.05)
    assert same.fit() is None and same.row_cost == 0.2
    # A batch that never changes, drafts that do: t_8 and b are known, a and e are not needed.
    fixed = StepCost(prior=0.2, min_steps=4)
    for i in range(30):
        fixed.observe(8, i % 9, 0.020 + 0.001 * (i % 9))
    assert fixed.threshold(8) == pytest.approx(0.008 / 0.020, rel=1e-6)


# A decode step's milliseconds by its rows, measured with the integer kernels on the default GGUF
# (2-core AVX-512 VNNI host): a tile takes four activation rows, so the fifth row costs a lot.
STAIRCASE_MS = {1: 2.35, 2: 3.37, 3: 4.87, 4: 5.05, 5: 6.45, 6: 7.6, 7: 8.6, 8: 9.28, 9: 10.92}
STAIRCASE_MS.update({10: 12.0, 11: 13.2, 12: 13.9, 13: 14.6, 14: 15.0, 15: 15.4, 16: 15.68})


def _staircase_speculator() -> Any:
    from cluster.config import SpeculativeConfig
    from cluster.engine.spec.speculator import Speculator

    spec = Speculator(SpeculativeConfig(method="ngram"), None)
    for i in range(200):  # batches of 1 and 8, 0-8 drafts each
        batch, drafts = (1, i % 9) if i % 2 else (8, i % 9)
        spec.step_cost.observe(batch, drafts, STAIRCASE_MS[batch + drafts] / 1000)
    return spec


def test_drafts_stop_where_the_step_cost_steps_up() -> None:
    """The number of drafts is the one that gives the step the most tokens a second: at batch 1
    with drafts accepted 9 times in 10, three (a full tile of four rows), where the linear rule
    (p ** j over b B / t_B) verified all eight, at 4.6x a one-row step; at batch 8 with drafts
    accepted 6 times in 10, none."""
    spec = _staircase_speculator()
    sure = [(0.9**j, 0, j) for j in range(1, 9)]
    assert all(chance > spec.threshold(1) for chance, _, _ in sure)  # the linear rule: all 8
    assert spec._most_tokens(sure, 1, 0, 24) == 3
    doubtful = [(0.6, i, 1) for i in range(8)]
    assert spec._most_tokens(doubtful, 8, 0, 24) == 0
    # rows that cost nothing more: every candidate is taken, up to the budget
    flat = StepCost(prior=0.1, min_steps=4)
    for i in range(40):
        flat.observe(1, i % 9, 0.002)
    spec.step_cost = flat
    assert spec._most_tokens(sure, 1, 0, 24) == 8 and spec._most_tokens(sure, 1, 0, 5) == 5
    # before any fit, the prior's line (1 + 0.1 rows): deep drafts for sure guesses
    spec.step_cost = StepCost(prior=0.1)
    assert spec._most_tokens(sure, 1, 0, 24) == 8


def test_rows_that_cost_much_draft_less_than_rows_that_cost_little() -> None:
    prompt = [7, 3, 9, 4, 7, 3, 9, 4, 7, 3, 9, 4]
    ref = _run(LLMEngine(fake_config()), {"a": prompt}, greedy(40))
    drafted = {}
    for per_row_s in (0.0, 0.004):
        eng = LLMEngine(fake_config(**{**SPEC, "decode.speculative.measure_row_cost": True}))
        use_proposer(eng, ScriptedProposer(ref, eng.vocab_size, wrong_share=0.5))
        execute = eng.runner.execute

        def slow(batch: Any, execute: Any = execute, per_row_s: float = per_row_s) -> Any:
            time.sleep(per_row_s * sum(it.num_new_tokens for it in batch.items))
            return execute(batch)

        eng.runner.execute = slow  # type: ignore[method-assign]
        assert _run(eng, {"a": prompt}, greedy(40)) == {"a": ref["a"]}
        spec = eng.stats()["spec"]
        drafted[per_row_s] = spec["num_draft_tokens"]
        if per_row_s:  # each row ~ all of a step's cost: c near 1 (bounds: a shared box)
            assert spec["row_cost"] > 0.3
        _finish_clean(eng)
    assert drafted[0.004] < drafted[0.0]


def test_usage_counts_drafted_and_accepted_tokens_per_request() -> None:
    prompt = [9, 8, 7, 6, 5]
    ref = _run(LLMEngine(fake_config()), {"a": prompt}, greedy(30))
    eng = LLMEngine(fake_config(**SPEC))
    use_proposer(eng, ScriptedProposer(ref, eng.vocab_size, wrong_share=0.2))
    eng.add(EngineRequest("a", prompt, greedy(30)))
    last = [o for o in _outputs(eng)["a"]][-1]
    spec = eng.stats()["spec"]
    assert last.num_draft_tokens == spec["num_draft_tokens"] > 0
    assert last.num_accepted_tokens == spec["num_accepted_tokens"] > 0
    assert spec["acceptance_rate"] == pytest.approx(
        last.num_accepted_tokens / last.num_draft_tokens
    )


def test_abort_with_drafts_verified_frees_everything() -> None:
    prompts = {f"r{i}": [4 + (i * 3 + j * 11) % 500 for j in range(20)] for i in range(3)}
    ref = _run(LLMEngine(fake_config()), prompts, greedy(40))
    eng = LLMEngine(fake_config(**SPEC))
    use_proposer(eng, ScriptedProposer(ref, eng.vocab_size, wrong_share=0.5))
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, greedy(40)))
    for _ in range(6):
        eng.step()
    assert eng.stats()["spec"]["num_verifications"] > 0
    for rid in prompts:
        eng.abort_request(rid)
    run_until_done(eng)
    _finish_clean(eng)


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("method", "eagle"),
        ("num_speculative_tokens", 0),
        ("min_ngram", 0),
        ("max_ngram", 1),
        ("max_batch_size", 0),
        ("max_num_draft_tokens", 0),
        ("min_acceptance_rate", 1.0),
        ("draft_row_cost", -0.1),
        ("max_pause_steps", 0),
        ("num_speculative_tokens", "4"),
    ],
)
def test_bad_speculative_config_names_the_field(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^decode\.speculative\.{key}"):
        load_config(overrides={f"decode.speculative.{key}": value})


def test_the_methods_config_accepts_are_the_registry() -> None:
    assert set(SPECULATIVE_METHODS) == {"none", *PROPOSERS}
    assert load_config().decode.speculative.method == "none"


def test_the_ngram_proposer_extends_its_token_arrays_and_forgets_them() -> None:
    """The proposer's per-request arrays follow the request's tokens as they grow, are rebuilt
    for a request id whose tokens are not the ones kept, and go when the request does."""
    from cluster.config import SpeculativeConfig
    from cluster.engine.request import Request
    from cluster.engine.spec.proposer import lookup_match

    prop = NgramProposer(SpeculativeConfig(method="ngram"))
    r = Request("a", [5, 6, 7, 8, 5, 6], greedy(200), seed=0)
    for token in [7, 8, 5, 6, 9] * 30:  # past the first buffer's capacity
        r.output_token_ids.append(token)
        got = prop.propose([r], [4])[0]
        want = lookup_match(np.asarray(r.all_token_ids), prop.min_n, prop.max_n, 4)[0]
        assert list(got) == want
        assert np.array_equal(prop._array(r), r.all_token_ids)
    other = Request("a", [1, 2, 3], greedy(5), seed=0)  # the same id, other tokens: rebuilt
    assert np.array_equal(prop._array(other), [1, 2, 3])
    prop.forget("a")
    assert "a" not in prop._tokens
