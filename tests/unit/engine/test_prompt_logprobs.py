"""Prompt logprobs (``SamplingParams.prompt_logprobs``, ``cluster.engine.prompt_logprobs``):
the log-softmax of the logits at every prompt position, exact against transformers on the tiny
random Llama, through chunked prefill, a warm prefix cache (skipped) and preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput
from tests.helpers import fake_config, greedy, tiny_config

K = 3


def _params(max_tokens: int = 4, k: int | None = K) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=k, logprobs=1)


def _tiny(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine(tiny_config(model_dir, **{"cache.num_blocks": 128, **overrides}))


def _run(eng: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
        eng.check_integrity()
    return outs


def _prompt_logprobs(outs: list[RequestOutput]) -> list[Any]:
    carrying = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and outs[0].prompt_logprobs is not None  # the first output only
    return carrying[0]


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir: Path) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    from tests.reference import load_hf

    hf = load_hf(tiny_model_dir)
    prompts = {
        "a": [3 + (i * 7) % 400 for i in range(45)],  # 3 chunks of 16, then 13
        "b": [5 + (i * 11) % 300 for i in range(32)],  # fills its last block
        "c": [9, 17, 4],
    }
    refs = {}
    with torch.inference_mode():
        for rid, p in prompts.items():
            logits = hf(torch.tensor([p])).logits[0].float()
            refs[rid] = torch.log_softmax(logits, dim=-1)
    return prompts, refs


def _check(entries: list[Any], prompt: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(len(prompt) - 1):
        lp, top = entries[p + 1]
        assert lp == pytest.approx(ref[p, prompt[p + 1]].item(), abs=1e-4), p
        vals, ids = ref[p].topk(K)
        assert [t for t, _ in top] == ids.tolist(), p
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)


@pytest.mark.parametrize("overrides", [{}, {"scheduler.chunk_size": 64}], ids=["chunked", "whole"])
def test_prompt_logprobs_match_transformers(
    tiny_model_dir: Path, hf_reference: Any, overrides: dict[str, Any]
) -> None:
    prompts, refs = hf_reference
    eng = _tiny(tiny_model_dir, **overrides)
    for rid, p in prompts.items():
        eng.add(EngineRequest(rid, p, _params()))
    outs = _run(eng)
    for rid, p in prompts.items():
        _check(_prompt_logprobs(outs[rid]), p, refs[rid])
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0


@pytest.mark.timeout(120)
def test_a_warm_prefix_cache_is_skipped_and_preemption_recomputes(
    tiny_model_dir: Path, hf_reference: Any
) -> None:
    """(Preempted every 4th step: a prompt whose logprobs are wanted restarts from 0, so with
    the cache skipped it needs that many steps between preemptions to get through.)"""
    prompts, refs = hf_reference
    eng = _tiny(tiny_model_dir, **{"testing.enabled": True, "testing.force_preempt_interval": 4})
    eng.add(EngineRequest("warm", prompts["a"], greedy(2)))  # caches a's blocks
    _run(eng)
    eng.add(EngineRequest("a", prompts["a"], _params(6)))
    eng.add(EngineRequest("b", prompts["b"], _params(6)))
    outs = _run(eng)
    assert outs["a"][-1].num_cached_tokens == 0  # no hit: every position is computed
    for rid in ("a", "b"):
        _check(_prompt_logprobs(outs[rid]), prompts[rid], refs[rid])
    assert eng.stats()["num_preemptions"] > 0
    assert eng.block_manager.num_used_blocks == 0


def test_fake_runner_scores_every_position_and_n_shares_them() -> None:
    eng = LLMEngine(fake_config())
    prompt = [1 + (i * 13) % 200 for i in range(40)]
    eng.add(EngineRequest("x", prompt, _params(3, k=0), n=3))
    outs = _run(eng)
    entries = _prompt_logprobs(outs["x"])
    assert len(entries) == 40 and all(top == [] for _, top in entries[1:])
    assert all(lp <= 0.0 for lp, _ in entries[1:])
    assert all(o.prompt_logprobs is None for rid in ("x#1", "x#2") for o in outs[rid])
    eng.check_integrity()


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="^prompt_logprobs: must be an integer in"):
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


def test_decode_role_prefills_such_requests_itself() -> None:
    dec = LLMEngine(fake_config(**{"decode.local_prefill_threshold": 4}), role="decode")
    prompt = list(range(1, 60))
    assert not dec.add(EngineRequest("x", prompt, _params(), prefill="auto")).remote
    with pytest.raises(ValueError, match="^prompt_logprobs: "):
        dec.add(EngineRequest("y", prompt, _params(), prefill="remote"))
    assert len(_prompt_logprobs(_run(dec)["x"])) == len(prompt)
    dec.check_integrity()
