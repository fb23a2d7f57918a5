"""Pipeline parallelism in one engine (``model.pipeline_parallel_size``): layers in stages on
their own ranks, each step's requests dealt into micro-batches that flow through the stages
(``pipeline``), against one rank token for token, with every driver-side feature; stages and
micro-batches counted; a dead stage fails the step. Every run ends with the integrity check.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.models.llama import LlamaArch
from cluster.engine.models.tensor_parallel import plan_stages
from cluster.engine.pipeline import deal
from cluster.engine.torch_runner import TorchModelRunner
from cluster.engine.tp_group import RankFailure
from tests.helpers import greedy, make_config, tiny_config
from tests.unit.engine.test_tensor_parallel import SCENARIOS, _arch, _run

pytestmark = pytest.mark.timeout(300)


class _Item:
    def __init__(self, n: int) -> None:
        self.num_new_tokens = n


def test_requests_are_dealt_whole_into_balanced_micro_batches_in_order() -> None:
    items = [_Item(n) for n in (1, 1, 40, 1, 30, 1, 1)]
    parts = deal(items, 2)  # type: ignore[arg-type]
    assert sorted(sum(it.num_new_tokens for it in p) for p in parts) == [35, 40]
    for p in parts:  # each keeps the batch's order
        assert [items.index(it) for it in p] == sorted(items.index(it) for it in p)
    assert sorted(id(it) for p in parts for it in p) == sorted(id(it) for it in items)
    assert len(deal(items[:2], 4)) == 2  # never an empty micro-batch  # type: ignore[arg-type]


def test_layers_split_into_contiguous_stages_and_too_many_stages_are_refused() -> None:
    arch: LlamaArch = _arch(num_layers=30)
    assert plan_stages(arch, 2) == [(0, 15), (15, 30)]
    assert plan_stages(arch, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="3 stages, but the model has 2 layers"):
        plan_stages(_arch(num_layers=2), 3)


def test_tensor_and_pipeline_parallelism_together_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2: tensor and pipeline"):
        make_config(**{"model.tensor_parallel_size": 2, "model.pipeline_parallel_size": 2})


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_stages_give_the_tokens_of_one_rank(tiny_model_dir: Path, scenario: str) -> None:
    params, overrides = SCENARIOS[scenario]
    one = _run(tiny_model_dir, 1, params, **overrides)
    staged = {
        **overrides,
        "model.tensor_parallel_size": 1,
        "model.pipeline_parallel_size": 2,
        "model.pipeline_microbatches": 3,
    }
    assert _run(tiny_model_dir, 1, params, **staged) == one


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.engine.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-4-layers"), num_layers=4)


@pytest.mark.parametrize(("stages", "micro"), [(3, 2), (4, 1), (2, 8)])
def test_more_stages_and_micro_batches_give_the_same_tokens(
    four_layers: Path, stages: int, micro: int
) -> None:
    params = greedy(8)
    one = _run(four_layers, 1, params)
    staged = {"model.pipeline_parallel_size": stages, "model.pipeline_microbatches": micro}
    assert _run(four_layers, 1, params, **staged) == one


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    config: ClusterConfig = tiny_config(
        model_dir,
        **{
            "cache.num_blocks": 64,
            "model.pipeline_parallel_size": 2,
            "model.tensor_parallel_timeout_s": 2.0,
            **overrides,
        },
    )
    return LLMEngine(config)


def test_a_step_flows_through_the_stages_in_micro_batches(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, **{"model.pipeline_microbatches": 2})
    try:
        runner = engine.runner
        assert isinstance(runner, TorchModelRunner) and runner.group is not None
        assert runner.model.first_layer == 0 and len(runner.model.layers) == 1  # of 2 layers
        for i in range(4):
            engine.add(EngineRequest(f"r{i}", list(range(5 + i, 30)), greedy(3)))
        engine.step()  # one prefill step of 4 requests: 2 micro-batches
        group = runner.group
        before = group.num_ops
        engine.step()  # a decode step: 1 broadcast; the queues are not group operations
        assert group.num_ops - before == 1
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
    finally:
        engine.close()


def test_a_dead_stage_fails_the_next_step_naming_it(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    try:
        runner = engine.runner
        assert isinstance(runner, TorchModelRunner) and runner._ranks is not None
        engine.add(EngineRequest("r", list(range(5, 30)), greedy(20)))
        engine.step()
        os.kill(runner._ranks.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 exited \(-9\)"):
            for _ in range(20):
                engine.step()
        assert time.monotonic() - t0 < 1.9
    finally:
        engine.close()


def test_seeded_sampling_is_the_same_through_the_stages(tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=10)
    one = _run(tiny_model_dir, 1, params)
    assert _run(tiny_model_dir, 1, params, **{"model.pipeline_parallel_size": 2}) == one
