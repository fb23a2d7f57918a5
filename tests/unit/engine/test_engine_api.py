"""Engine and offline-API boundaries: bad input is refused clearly and disturbs nobody."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.engine import LLMEngine
from tests.helpers import fake_config, greedy, run_until_done


def test_a_bad_request_never_disturbs_the_batch() -> None:
    ref_eng = LLMEngine(fake_config())
    ref_eng.add("good", [5, 6, 7, 8, 9], greedy(10))
    expected = run_until_done(ref_eng)["good"]

    eng = LLMEngine(fake_config(**{"model.max_model_len": 64}))
    eng.add("good", [5, 6, 7, 8, 9], greedy(10))
    first = [t for o in eng.step() for t in o.new_token_ids]
    bad = [
        ([], greedy(4), "prompt"),
        (list(range(1, 65)), greedy(4), "prompt"),
        (list(range(1, 60)), greedy(10), "max_tokens"),
        ([1, 2, 99999], greedy(4), "prompt_token_ids"),
    ]
    for i, (prompt, params, field) in enumerate(bad):
        with pytest.raises(ValueError, match=rf"^{field}:"):
            eng.add(f"bad{i}", prompt, params)
    with pytest.raises(ValueError, match="^request_id: 'good' already exists"):
        eng.add("good", [1, 2], greedy(2))
    with pytest.raises(ValueError, match="^max_tokens: .*KV blocks"):
        LLMEngine(fake_config(**{"cache.num_blocks": 2})).add("x", [1] * 30, greedy(10))
    assert first + run_until_done(eng)["good"] == expected
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


def test_stop_conditions() -> None:
    eng = LLMEngine(fake_config())
    eng.add("a", [5, 6, 7], greedy(10))
    tokens = run_until_done(eng)["a"]
    eng.add(
        "b", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[3]])
    )
    eng.add("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    b_tokens = [t for o in outs["b"] for t in o.new_token_ids]
    assert b_tokens == tokens[: tokens.index(tokens[3]) + 1]
    assert outs["b"][-1].finish_reason == "stop"
    assert outs["c"][-1].finish_reason == "length" and len(outs["c"]) == 3
    eng.check_integrity()


def test_offline_llm_api(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_blocks=256, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=5)
    (a,) = llm.generate("The quick brown fox", params)
    (b,) = llm.generate(llm.tokenizer.encode("The quick brown fox"), params)
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 5 and a.finish_reason
    assert a.text == llm.tokenizer.decode(a.token_ids)
    outs = llm.generate(["one", "two, three"], [params, SamplingParams(max_tokens=2, seed=1)])
    assert len(outs) == 2
    (c,) = llm.chat([{"role": "user", "content": "hi"}], params)
    assert c.prompt_token_ids[0] == llm.tokenizer.token_to_id("<|im_start|>")
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate(["fine", ""], params)
    with pytest.raises(ValueError, match="params: 1 given for 2 prompts"):
        llm.generate(["a", "b"], [params])
    with pytest.raises(ValueError, match="^blok_size: unknown engine option"):
        LLM(str(tiny_model_dir), blok_size=3)
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
    streamed = "".join(o.new_text for o in llm.stream("The quick brown fox", params))
    assert streamed == a.text
