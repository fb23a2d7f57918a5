"""The GPU path inside the engine on a device (``pytest -m gpu tests/gpu/test_gpu_engine.py``, a
process without Triton's interpreter): the runner picks Triton attention, captured decode
steps and device sampling on CUDA; greedy outputs with the graphs on equal those with them off
(and the plain torch path's, ``model.kernels: torch``) token for token, and both match
transformers as test_cuda.py's exactness test expects. Skipped without a CUDA device."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.gpu.plan import GpuPath
from tests.gpu.test_cuda import _prompts, cuda_references
from tests.helpers import greedy, make_config, run_until_done
from tests.reference import capture_logits, check_run_against_references

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("Triton's interpreter is on in this process", allow_module_level=True)


def _engine(model_dir: Path, graphs: bool, **overrides: Any) -> LLMEngine:
    cfg = make_config(
        **{
            "model.path": str(model_dir),
            "model.device": "cuda",
            "cache.num_blocks": 256,
            **overrides,
        }
    )
    engine = LLMEngine(cfg)
    if not graphs:
        engine.runner.graphs = None  # type: ignore[attr-defined]
    return engine


def _greedy_run(engine: LLMEngine, prompts: dict[str, list[int]], n: int = 32) -> Any:
    captured = capture_logits(engine)
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(n)))
    tokens = run_until_done(engine)
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return tokens, captured


def test_cuda_runner_picks_the_gpu_path(real_model_dir: Path) -> None:
    engine = _engine(real_model_dir, True, **{"model.dtype": "bfloat16"})
    runner: Any = engine.runner
    assert runner.gpu == GpuPath(True, True, True), runner.gpu.describe()
    assert runner.graphs is not None and runner.graphs.graphs  # captured
    assert runner.kv_cache.shape[0] == runner.num_blocks + 1  # the scratch block
    plain: Any = _engine(real_model_dir, False, **{"model.kernels": "torch"}).runner
    assert plain.gpu.triton_attention is False and plain.graphs is None


def test_graphs_on_and_off_match_transformers(real_model_dir: Path) -> None:
    """fp32 (as the reference): graphs on, graphs off and the plain torch path each within
    test_cuda's tolerances of transformers on CUDA; graphs on and off token-identical; the
    graphs did run."""
    prompts, refs = cuda_references(real_model_dir)
    arms = {
        "graphs": (True, {}),
        "eager": (False, {}),
        "torch": (False, {"model.kernels": "torch"}),
    }
    runs = {}
    for arm, (graphs, over) in arms.items():
        engine = _engine(real_model_dir, graphs, **{"model.dtype": "float32", **over})
        tokens, captured = _greedy_run(engine, prompts)
        check_run_against_references(engine, prompts, refs, tokens, captured)
        if graphs:
            assert engine.runner.graphs.last_mode == "graph"  # type: ignore[attr-defined]
        runs[arm] = tokens
    assert runs["graphs"] == runs["eager"]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_bf16_graphs_and_eager_steps_agree(real_model_dir: Path, kv: str) -> None:
    """bf16 weights (bf16 or int8 KV): 4 prompts of 24 tokens prefill in one step through the
    Triton prefill kernel, then decode together as bucket 4 (no pad rows), so captured and
    eager steps run the same kernels: identical greedy tokens."""
    prompts = {rid: (p * 8)[:24] for rid, p in _prompts(real_model_dir).items()}
    over = {"model.dtype": "bfloat16", "cache.kv_dtype": kv}
    on, _ = _greedy_run(_engine(real_model_dir, True, **over), prompts)
    off, _ = _greedy_run(_engine(real_model_dir, False, **over), prompts)
    assert on == off


def test_seeded_sampling_on_the_device_is_reproducible(real_model_dir: Path) -> None:
    prompts = _prompts(real_model_dir)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=11)
    runs = []
    for _ in range(2):
        engine = _engine(real_model_dir, True, **{"model.dtype": "bfloat16"})
        for rid, p in prompts.items():
            engine.add(EngineRequest(rid, p, params))
        runs.append(run_until_done(engine))
    assert runs[0] == runs[1]
    assert all(len(t) == 24 for t in runs[0].values())
