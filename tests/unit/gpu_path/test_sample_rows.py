"""``device_sampler.sample_rows``, the sampler the torch runner hands ``sample_and_verify`` on
CUDA: ``sampler.sample``'s contract, each supported row drawn on the device and the others on
the host, row by row, so a row's token does not depend on the rows around it."""

from __future__ import annotations

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.gpu.device_sampler import DeviceSamplingParams, sample_on_device, sample_rows
from cluster.engine.sampler import SampleRequest, sample

pytestmark = pytest.mark.timeout(60)

V = 64


def _row(seed: int, index: int = 3, suppress: tuple[int, ...] = (), **kw: object) -> SampleRequest:
    return SampleRequest(SamplingParams(**kw), seed, index, [1, 2], [3], suppress)  # type: ignore[arg-type]


def _logits(b: int) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(5)) * 3.0


def test_supported_rows_on_the_device_the_others_on_the_host() -> None:
    rows = [
        _row(1, temperature=0.9, top_k=20, logprobs=3),  # device
        _row(2, temperature=0.0, logprobs=2),  # greedy, supported: device (the argmax)
        _row(3, temperature=0.7, repetition_penalty=1.3),  # penalties: host
        _row(4, temperature=1.0, top_p=0.8),  # device, no logprobs asked
        _row(5, suppress=(7,), temperature=0.5),  # below min_tokens: host
    ]
    logits = _logits(len(rows))
    got = sample_rows(logits, rows)
    dev = [0, 1, 3]
    want = sample_on_device(
        logits[dev], DeviceSamplingParams.of([rows[i] for i in dev], logits.device), 3
    )
    ids, lps, tops = want.to_host()
    assert lps is not None and got.logprobs is not None and got.top_logprobs is not None
    host = sample(logits[[2, 4]], [rows[2], rows[4]])
    assert got.token_ids == [ids[0], ids[1], host.token_ids[0], ids[2], host.token_ids[1]]
    assert got.token_ids[1] == int(logits[1].argmax())
    assert got.logprobs[:2] == lps[:2] and got.logprobs[2:] == [0.0, 0.0, 0.0]
    assert got.top_logprobs[0] == tops[0][:3] and got.top_logprobs[1] == tops[1][:2]
    assert got.top_logprobs[2:] == [[], [], []]


def test_a_rows_token_does_not_depend_on_its_neighbours() -> None:
    row = _row(9, temperature=0.8, top_p=0.95)
    logits = _logits(2)[[0, 1, 0]]  # rows 0 and 2 the same logits
    alone = sample_rows(logits[:1], [row]).token_ids[0]
    with_host_rows = sample_rows(logits, [row, _row(1, presence_penalty=0.5, temperature=1.0), row])
    assert with_host_rows.token_ids[0] == with_host_rows.token_ids[2] == alone


def test_greedy_only_steps_and_unsupported_only_steps_are_the_host_samplers() -> None:
    logits = _logits(3)
    greedy = [_row(i, temperature=0.0, logprobs=1) for i in range(3)]
    assert sample_rows(logits, greedy) == sample(logits, greedy)
    host = [_row(i, temperature=0.9, logit_bias=((3, 2.0),)) for i in range(3)]
    assert sample_rows(logits, host) == sample(logits, host)
