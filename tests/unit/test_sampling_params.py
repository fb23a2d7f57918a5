from __future__ import annotations

import math

import pytest

from cluster.common.sampling_params import SamplingParams, validate_prompt


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": "x"}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),  # bounded: checked per token
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_valid_edges_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=0, min_p=1.0, logprobs=20)
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    assert p.stop == ("a", "b") and hash(p)
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="^nope: unknown sampling parameter"):
        SamplingParams.from_dict({"nope": 1})


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "field"),
    [
        ([], 4, "prompt"),
        (list(range(100)), 4, "prompt"),  # prompt >= max_model_len
        (list(range(99)), 4, "max_tokens"),  # prompt + max_tokens > context
        ([1, 2, 500], 4, "prompt_token_ids"),
        ([1, -2], 4, "prompt_token_ids"),
    ],
)
def test_request_checks_against_the_model(prompt: list[int], max_tokens: int, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        validate_prompt(
            prompt, SamplingParams(max_tokens=max_tokens), vocab_size=500, max_model_len=100
        )


def test_boundary_lengths() -> None:
    params = SamplingParams(max_tokens=1)
    validate_prompt(list(range(99)), params, vocab_size=500, max_model_len=100)  # len - 1: ok
    with pytest.raises(ValueError, match="^prompt:"):
        validate_prompt(list(range(100)), params, vocab_size=500, max_model_len=100)
    with pytest.raises(ValueError, match="^stop_token_ids:"):
        validate_prompt(
            [1], SamplingParams(stop_token_ids=[600]), vocab_size=500, max_model_len=100
        )
