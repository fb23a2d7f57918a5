"""logit_bias and stop strings kept in the output (include_stop_str_in_output), in the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import fake_config, greedy, make_config, run_until_done


def _text(
    eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[str, list[int]]:
    eng.add(EngineRequest(rid, prompt, params))
    text, tokens = "", []
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.new_text
            tokens += out.new_token_ids
    eng.check_integrity()
    return text, tokens


def test_logit_bias_bans_tokens() -> None:
    eng = LLMEngine(fake_config())
    prompt = [5, 6, 7, 8]
    eng.add(EngineRequest("plain", prompt, greedy(8)))
    plain = run_until_done(eng)["plain"]
    eng.add(EngineRequest("banned", prompt, greedy(8, logit_bias={t: -100.0 for t in set(plain)})))
    banned = run_until_done(eng)["banned"]
    assert len(banned) == 8 and not set(banned) & set(plain)
    eng.check_integrity()


def test_logit_bias_forces_a_token_greedy_and_sampled(tiny_model_dir: Path) -> None:
    """On a real (tiny random) Llama, whose logits are small: +100 outweighs them all."""
    config = make_config(**{"model.path": str(tiny_model_dir), "cache.num_blocks": 64})
    eng = LLMEngine(config)
    prompt = [5, 6, 7, 8]
    eng.add(EngineRequest("forced", prompt, greedy(6, logit_bias={42: 100})))
    eng.add(
        EngineRequest(
            "sampled", prompt, SamplingParams(max_tokens=6, seed=3, logit_bias=((42, 100.0),))
        )
    )
    eng.add(EngineRequest("plain", prompt, SamplingParams(max_tokens=6, seed=3, ignore_eos=True)))
    out = run_until_done(eng)
    assert out["forced"] == [42] * 6 and out["sampled"] == [42] * 6
    assert out["plain"] != [42] * 6
    eng.check_integrity()


@pytest.mark.parametrize("bad", [{-1: 1.0}, {5: 100.5}, {5: float("nan")}, ((5,),), {True: 1}])
def test_bad_logit_bias_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="^logit_bias: "):
        SamplingParams(logit_bias=bad)  # type: ignore[arg-type]


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    eng = LLMEngine(fake_config())
    with pytest.raises(ValueError, match="^logit_bias: token id 600 is outside"):
        eng.add(EngineRequest("x", [1, 2], greedy(2, logit_bias={600: 1.0})))
    assert not eng.requests


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_kept_or_cut(include: bool) -> None:
    eng = LLMEngine(fake_config())
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    full, tokens = _text(eng, "ref", prompt, params)
    stop = f" t{tokens[3]}"
    with_stop = dataclasses.replace(params, stop=(stop,), include_stop_str_in_output=include)
    text, _ = _text(eng, "x", prompt, with_stop)
    cut = full[: full.index(stop)]
    assert text == (cut + stop if include else cut)
    assert not eng.requests and eng.block_manager.num_used_blocks == 0
