"""How the torch runner wires the GPU path in: the decision (``gpu.plan.choose_gpu_path``) for
the CPU and for a pretend CUDA device; a CPU runner untouched by it; and the wiring itself run
on the CPU with every part forced on (Triton kernels under the interpreter, the graphs' CPU
twin over a scratch block, the device sampler): greedy tokens identical to the CPU path's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.gpu import device_sampler
from cluster.engine.gpu.plan import GpuPath, choose_gpu_path
from cluster.engine.gpu.triton_attention import prefill_kernel_for, triton_paged_decode
from cluster.engine.torch_runner import TorchModelRunner
from tests.helpers import greedy, run_until_done, tiny_config

pytestmark = pytest.mark.timeout(300)


def _choose(**kw: Any) -> GpuPath:
    facts: dict[str, Any] = {
        "device_type": "cuda",
        "kernels": "auto",
        "kv_dtype": "bfloat16",
        "head_dim": 64,
        "triton_available": True,
    }
    return choose_gpu_path(**{**facts, **kw})


def test_the_cpu_gets_none_of_the_gpu_path() -> None:
    for kernels in ("auto", "native", "torch"):
        for kv in ("float32", "int8"):
            assert _choose(device_type="cpu", kernels=kernels, kv_dtype=kv) == GpuPath()
    assert GpuPath().describe() == "plain torch ops, the host sampler"


def test_cuda_gets_every_part_where_it_can_run() -> None:
    for kv in ("float16", "bfloat16", "float32", "int8"):
        assert _choose(kv_dtype=kv) == GpuPath(True, True, True)
    full = _choose().describe()
    assert "Triton" in full and "CUDA graphs" in full and "device" in full


@pytest.mark.parametrize(
    ("facts", "expect", "why"),
    [
        ({"kernels": "torch"}, (False, False, False), "model.kernels: torch"),
        ({"triton_available": False}, (False, False, True), "Triton does not import"),
        ({"kv_dtype": "int8", "head_dim": 66}, (False, False, True), "int8 KV cache of head"),
        ({"tensor_parallel": True}, (True, False, True), "tensor parallelism"),
        ({"moe": True}, (True, False, True), "mixture-of-experts"),
        ({"packed_weights": True}, (True, False, True), "packed weights"),
    ],
)
def test_cuda_parts_off_and_why(facts: dict[str, Any], expect: tuple[bool, ...], why: str) -> None:
    path = _choose(**facts)
    assert (path.triton_attention, path.cuda_graphs, path.device_sampling) == expect
    assert why in "; ".join(path.reasons)
    assert why in path.describe()


def _prompts(engine: LLMEngine) -> dict[str, list[int]]:
    tok = engine.tokenizer
    words = ("the quick brown fox jumps over the lazy dog and counts one two three " * 6).split()
    return {f"r{i}": tok.encode(" ".join(words[: 5 + 13 * i])) for i in range(4)}


def _run(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams | None = None
) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, params or greedy(12)))
    return run_until_done(engine)


def test_a_cpu_runner_is_untouched(tiny_model_dir: Path) -> None:
    engine = LLMEngine(tiny_config(tiny_model_dir, **{"cache.num_blocks": 64}))
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    assert runner.gpu == GpuPath() and runner.graphs is None
    assert runner.decode_kernel is not triton_paged_decode
    assert runner.kv_cache.shape[0] == runner.num_blocks == engine.block_manager.num_blocks == 64


def test_the_cuda_wiring_runs_on_the_cpu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain torch ops on the CPU as the reference; then the same runner with every part of
    the GPU path forced on: prefill chunks (16 tokens, mixed with decodes) through the Triton
    prefill kernel, decode rows through the Triton decode kernel, decode-only steps through the
    graphs' twin (buckets up to 4: the step's rows), one scratch block past the block manager's.
    Greedy tokens are identical; a sampled, seeded request goes through the device sampler and
    draws the same tokens twice."""
    overrides = {"cache.num_blocks": 64, "model.kernels": "torch", "scheduler.max_num_seqs": 4}
    plain = LLMEngine(tiny_config(tiny_model_dir, **overrides))
    prompts = _prompts(plain)
    ref = _run(plain, prompts)

    monkeypatch.setattr(TorchModelRunner, "_gpu_path", lambda self, cfg: GpuPath(True, True, True))
    engine = LLMEngine(tiny_config(tiny_model_dir, **overrides))
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    assert runner.decode_kernel is triton_paged_decode
    assert runner.graphs is not None and runner.graphs.buckets == (1, 2, 4)
    assert runner.graphs.scratch_block == runner.num_blocks == engine.block_manager.num_blocks
    assert runner.kv_cache.shape[0] == runner.num_blocks + 1
    modes: list[str] = []
    run = runner.graphs.run

    def recording_run(*args: Any) -> Any:
        out = run(*args)
        modes.append(runner.graphs.last_mode if runner.graphs is not None else "")
        return out

    monkeypatch.setattr(runner.graphs, "run", recording_run)
    chunks: list[int] = []

    def counting_prefill(prefills: list[Any], device: Any) -> Any:
        chunks.append(len(prefills))
        return prefill_kernel_for(prefills, device)

    monkeypatch.setattr("cluster.engine.torch_runner.prefill_kernel_for", counting_prefill)
    assert _run(engine, prompts) == ref
    assert modes and set(modes) == {"twin"} and sum(chunks) >= 4
    engine.check_integrity()

    drawn: list[int] = []
    on_device = device_sampler.sample_on_device

    def counting(logits: Any, *args: Any, **kw: Any) -> Any:
        drawn.append(logits.shape[0])
        return on_device(logits, *args, **kw)

    monkeypatch.setattr(device_sampler, "sample_on_device", counting)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)
    sampled = [_run(engine, prompts, params) for _ in range(2)]
    assert sampled[0] == sampled[1] and sum(drawn) == 2 * 12 * len(prompts)


def test_seeded_tokens_on_the_gpu_path_do_not_depend_on_speculation(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts' rows are drawn by the device sampler too (row by row, ``sample_rows``), so a
    seeded request gives the same tokens with prompt-lookup speculation on and off, as on the
    host sampler; the verify rows run through the graphs' twin (buckets up to 4 x 5 rows)."""
    monkeypatch.setattr(TorchModelRunner, "_gpu_path", lambda self, cfg: GpuPath(True, True, True))
    params = SamplingParams(temperature=0.7, top_k=8, max_tokens=16, ignore_eos=True, seed=3)
    runs = {}
    for method in ("none", "ngram"):
        overrides = {
            "cache.num_blocks": 64,
            "model.kernels": "torch",
            "scheduler.max_num_seqs": 4,
            "decode.speculative.method": method,
            "decode.speculative.num_speculative_tokens": 4,
            "decode.speculative.min_ngram": 1,  # a random model's tokens: draft often
            "decode.speculative.min_acceptance_rate": 0.0,
            "decode.speculative.measure_row_cost": False,
            "decode.speculative.draft_row_cost": 0.01,
        }
        engine = LLMEngine(tiny_config(tiny_model_dir, **overrides))
        graphs = engine.runner.graphs  # type: ignore[attr-defined]
        assert graphs is not None and graphs.buckets[-1] == (4 if method == "none" else 32)
        sizes: list[int] = []
        run = graphs.run

        def recording_run(ids: Any, *args: Any, run: Any = run, sizes: list[int] = sizes) -> Any:
            sizes.append(ids.shape[0])
            return run(ids, *args)

        monkeypatch.setattr(graphs, "run", recording_run)
        runs[method] = _run(engine, _prompts(engine), params)
        engine.check_integrity()
        assert max(sizes) == 4 if method == "none" else max(sizes) > 4  # drafts' rows in
    assert runs["none"] == runs["ngram"]


def test_a_failed_capture_leaves_the_steps_eager(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from cluster.engine.gpu.graphs import StepGraphs

    def fail(self: StepGraphs, warmup: int = 2) -> float:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(TorchModelRunner, "_gpu_path", lambda self, cfg: GpuPath(True, True, True))
    monkeypatch.setattr(StepGraphs, "capture_all", fail)
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: None)
    overrides = {"cache.num_blocks": 64, "model.kernels": "torch", "scheduler.max_num_seqs": 4}
    engine = LLMEngine(tiny_config(tiny_model_dir, **overrides))
    assert engine.runner.graphs is None  # type: ignore[attr-defined]
    assert "capture failed" in caplog.text
    prompts = _prompts(engine)
    assert set(_run(engine, prompts)) == set(prompts)
